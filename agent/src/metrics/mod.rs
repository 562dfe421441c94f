//! Prometheus metrics: `GET /metrics` on `[metrics] listen`, in the
//! OpenMetrics text format.
//!
//! Two kinds of metric:
//! - migration metrics ([`MigrationMetrics`]), recorded when a migration
//!   this node ran as the source ends (`crate::reports::Reports::store`);
//! - the node's state ([`NodeCollector`]), read at each scrape: data-plane
//!   packet counters (the BPF maps GetDataPlane reads), load, membership,
//!   managed processes.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `ferry_migrations_total` | counter | strategy, outcome, sockets |
//! | `ferry_migration_freeze_seconds` | histogram | strategy, outcome, sockets |
//! | `ferry_migration_duration_seconds` | histogram | strategy, outcome, sockets |
//! | `ferry_migration_transferred_bytes_total` | counter | strategy, outcome, sockets |
//! | `ferry_migration_image_bytes_total` | counter | strategy, outcome, sockets |
//! | `ferry_dataplane_packets_total` | counter | kind |
//! | `ferry_node_load` | gauge | |
//! | `ferry_cluster_nodes` | gauge | |
//! | `ferry_membership_members` | gauge | state |
//! | `ferry_membership_rejected_datagrams_total` | counter | reason |
//! | `ferry_managed_processes` | gauge | |
//! | `ferry_agent_info` | gauge (1) | node, version |

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

pub mod migrations;

pub use migrations::{DURATION_BUCKETS, FREEZE_BUCKETS, MigrationMetrics};

use crate::node::Node;

/// The OpenMetrics text format, as Prometheus asks for it.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("binding the metrics listener {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// The registry `/metrics` encodes: the agent's migration metrics and its
/// state at scrape time. Holds the agent weakly: the HTTP server does not
/// keep it alive.
pub fn registry(node: &Arc<Node>) -> Registry {
    let mut registry = Registry::default();
    node.reports.metrics.register(&mut registry);
    registry.register_collector(Box::new(NodeCollector {
        node: Arc::downgrade(node),
    }));
    registry
}

/// Encodes `registry` in the OpenMetrics text format. Blocking: collectors
/// read BPF maps.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    Ok(text)
}

/// The node's state, read at each scrape.
#[derive(Debug)]
pub struct NodeCollector {
    node: Weak<Node>,
}

impl prometheus_client::collector::Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(node) = self.node.upgrade() else {
            return Ok(());
        };
        {
            let info = ConstGauge::new(1i64);
            let mut e = encoder.encode_descriptor(
                "ferry_agent_info",
                "This agent: its node name and version",
                None,
                info.metric_type(),
            )?;
            let labels = [
                ("node", node.node()),
                ("version", env!("CARGO_PKG_VERSION")),
            ];
            info.encode(e.encode_family(&labels)?)?;
        }
        encode_dataplane(&node, &mut encoder)?;
        gauge(
            &mut encoder,
            "ferry_managed_processes",
            "Processes under this agent's management",
            node.processes.registry().len() as i64,
        )?;
        gauge(
            &mut encoder,
            "ferry_cluster_nodes",
            "Nodes this agent knows, itself included: configured peers and the live ones \
             membership found",
            node.cluster.known_peers().len() as i64 + 1,
        )?;
        if let Some(conductor) = &node.conductor {
            let load = ConstGauge::new(conductor.local_load());
            let e = encoder.encode_descriptor(
                "ferry_node_load",
                "This node's load as the balancer measures it (runnable processes per CPU, \
                 smoothed)",
                None,
                load.metric_type(),
            )?;
            load.encode(e)?;
        }
        if let Some(membership) = node.cluster.membership() {
            let members = membership.members();
            let mut e = encoder.encode_descriptor(
                "ferry_membership_members",
                "Other nodes SWIM membership knows, by state",
                None,
                MetricType::Gauge,
            )?;
            for state in [
                crate::membership::MemberState::Alive,
                crate::membership::MemberState::Suspect,
                crate::membership::MemberState::Down,
            ] {
                let n = members.iter().filter(|m| m.state == state).count() as i64;
                ConstGauge::new(n).encode(e.encode_family(&[("state", state.as_str())])?)?;
            }
            let rejected = membership.rejected();
            let mut e = encoder.encode_descriptor(
                "ferry_membership_rejected_datagrams",
                "Membership datagrams dropped for want of a valid MAC ([tls] membership_key), \
                 by reason: unauthenticated (no or a wrong MAC), stale (timestamp too far off)",
                None,
                MetricType::Counter,
            )?;
            for (reason, n) in [
                ("unauthenticated", rejected.unauthenticated),
                ("stale", rejected.stale),
            ] {
                ConstCounter::new(n).encode(e.encode_family(&[("reason", reason)])?)?;
            }
        }
        Ok(())
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    let e = encoder.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(e)
}

/// The counters GetDataPlane reports, one series per kind.
fn encode_dataplane(node: &Node, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let (c, totals) = match node.dataplane.counters() {
        Ok(v) => v,
        Err(e) => {
            // The rest of the scrape is still worth having.
            tracing::warn!(error = %e, "reading the data plane's counters for /metrics");
            return Ok(());
        }
    };
    let translation = match node.dataplane.flows().counters() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "reading the translator's counters for /metrics");
            None
        }
    };
    let mut rows = vec![
        ("passed", c.passed),
        ("dropped_not_owned", c.dropped_not_owned),
        ("dropped_frozen", c.dropped_frozen),
        ("passed_other", c.passed_other),
        ("egress_blocked", c.egress_blocked),
        ("captured", c.captured),
        ("capture_lost", c.capture_lost),
        ("recorded", c.recorded),
        ("replayed", totals.replayed),
        ("skipped_delivered", totals.skipped_delivered),
        ("replay_failed", totals.failed),
    ];
    if let Some(t) = translation {
        rows.push(("translated", t.translated_egress + t.translated_ingress));
        rows.push(("held", t.held));
    }
    let mut e = encoder.encode_descriptor(
        "ferry_dataplane_packets",
        "Packets the data plane handled since its maps were created, by what it did with them \
         (the counters of GetDataPlane)",
        None,
        MetricType::Counter,
    )?;
    for (kind, value) in rows {
        ConstCounter::new(value).encode(e.encode_family(&[("kind", kind)])?)?;
    }
    Ok(())
}

/// Serves `GET /metrics` on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let registry = Arc::new(registry);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a metrics connection");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stopped(&mut shutdown) => break,
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(req, registry.clone()));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "metrics connection");
            }
        });
    }
}

async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    // The guard `wait_for` returns must not live across an await.
    let _ = rx.wait_for(|stop| *stop).await.map(|_| ());
}

/// Binds `addr` for [`serve`].
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, MetricsError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })
}

type Body = http_body_util::Full<bytes::Bytes>;

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    registry: Arc<Registry>,
) -> Result<hyper::Response<Body>, std::convert::Infallible> {
    use hyper::{Method, StatusCode, header};
    let reply = |status: StatusCode, content_type: &str, body: String| {
        let mut r = hyper::Response::new(Body::from(body));
        *r.status_mut() = status;
        if let Ok(v) = header::HeaderValue::from_str(content_type) {
            r.headers_mut().insert(header::CONTENT_TYPE, v);
        }
        r
    };
    const TEXT: &str = "text/plain; charset=utf-8";
    if req.uri().path() != "/metrics" {
        return Ok(reply(
            StatusCode::NOT_FOUND,
            TEXT,
            "ferryd serves its metrics at /metrics\n".into(),
        ));
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "GET /metrics\n".into(),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return Ok(r);
    }
    // BPF map reads and procfs: off the runtime.
    let encoded = tokio::task::spawn_blocking(move || encode(&registry)).await;
    Ok(match encoded {
        Ok(Ok(text)) => reply(StatusCode::OK, CONTENT_TYPE, text),
        Ok(Err(e)) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            TEXT,
            format!("encoding the metrics: {e}\n"),
        ),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            TEXT,
            format!("metrics task: {e}\n"),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_proto::v1::{self as pb, MigrationReport};

    fn report(outcome: pb::MigrationOutcome, freeze_us: u64) -> MigrationReport {
        MigrationReport {
            migration_id: "m".into(),
            strategy: pb::Strategy::TotalCopy as i32,
            outcome: outcome as i32,
            freeze_time_us: freeze_us,
            total_time_us: 300_000,
            bytes_transferred: 1_000,
            image_bytes: 900,
            sockets: pb::SocketMigration::Collective as i32,
            ..Default::default()
        }
    }

    fn encoded(m: &MigrationMetrics) -> String {
        let mut r = Registry::default();
        m.register(&mut r);
        encode(&r).unwrap()
    }

    #[test]
    fn finished_migrations_are_counted_by_strategy_and_outcome() {
        let m = MigrationMetrics::default();
        m.record(&report(pb::MigrationOutcome::Committed, 30_000));
        m.record(&report(pb::MigrationOutcome::Committed, 70_000));
        // Failed before the freeze: counted, but no freeze to observe.
        m.record(&report(pb::MigrationOutcome::Aborted, 0));
        let text = encoded(&m);
        let has = |line: &str| {
            assert!(
                text.lines().any(|l| l == line),
                "no line {line:?} in:\n{text}"
            )
        };
        has(
            r#"ferry_migrations_total{strategy="total_copy",outcome="committed",sockets="collective"} 2"#,
        );
        has(
            r#"ferry_migrations_total{strategy="total_copy",outcome="aborted",sockets="collective"} 1"#,
        );
        has(
            r#"ferry_migration_freeze_seconds_count{strategy="total_copy",outcome="committed",sockets="collective"} 2"#,
        );
        has(
            r#"ferry_migration_freeze_seconds_bucket{le="0.05",strategy="total_copy",outcome="committed",sockets="collective"} 1"#,
        );
        has(
            r#"ferry_migration_freeze_seconds_bucket{le="0.1",strategy="total_copy",outcome="committed",sockets="collective"} 2"#,
        );
        has(
            r#"ferry_migration_freeze_seconds_count{strategy="total_copy",outcome="aborted",sockets="collective"} 0"#,
        );
        has(
            r#"ferry_migration_duration_seconds_count{strategy="total_copy",outcome="aborted",sockets="collective"} 1"#,
        );
        has(
            r#"ferry_migration_transferred_bytes_total{strategy="total_copy",outcome="committed",sockets="collective"} 2000"#,
        );
        has(
            r#"ferry_migration_image_bytes_total{strategy="total_copy",outcome="committed",sockets="collective"} 1800"#,
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn every_outcome_is_there_from_the_start() {
        let text = encoded(&MigrationMetrics::default());
        for outcome in ["committed", "aborted"] {
            let line = format!(
                r#"ferry_migrations_total{{strategy="total_copy",outcome="{outcome}",sockets="iterative"}} 0"#
            );
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
    }

    /// An HTTP/1.0 request to `addr`: (status line, body).
    async fn http(addr: SocketAddr, method: &str, path: &str) -> (String, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("{method} {path} HTTP/1.0\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_owned(), body.to_owned())
    }

    #[tokio::test]
    async fn serves_the_agents_migrations_and_state() {
        let dir = tempfile::tempdir().unwrap();
        let toml = format!(
            "node = \"node7\"\nwork_dir = \"{}\"\n[public]\ninterface = \"pub0\"\n\
             address = \"198.18.0.100\"\n[cluster]\ninterface = \"clu0\"\n\
             address = \"198.19.0.7\"\npeer_listen = \"198.19.0.7:7100\"\n\
             [[peers]]\nname = \"node8\"\naddress = \"198.19.0.8:7100\"\n",
            dir.path().display()
        );
        let config =
            crate::config::Config::parse(&toml, std::path::Path::new("test.toml")).unwrap();
        let node = Node::build(crate::node::NodeParts {
            config,
            filter: Box::new(crate::dataplane::filter::fake::FakeFilter::default()),
            replayer: Box::new(crate::dataplane::replay::fake::FakeReplayer::default()),
            flows: Box::new(crate::dataplane::translation::fake::FakeFlowRules::default()),
            tls: None,
            membership: None,
            criu: Arc::new(crate::criu::InstalledCriu("/nonexistent/criu".into())),
            links: None,
        });
        // The hook every finished source migration goes through.
        node.reports
            .store(report(pb::MigrationOutcome::Committed, 30_000));

        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve(listener, registry(&node), stopped));

        let (status, text) = http(addr, "GET", "/metrics").await;
        assert!(status.ends_with("200 OK"), "{status}");
        let info = format!(
            r#"ferry_agent_info{{node="node7",version="{}"}} 1"#,
            env!("CARGO_PKG_VERSION")
        );
        for line in [
            r#"ferry_migrations_total{strategy="total_copy",outcome="committed",sockets="collective"} 1"#,
            &info,
            r#"ferry_dataplane_packets_total{kind="passed"} 0"#,
            r#"ferry_dataplane_packets_total{kind="translated"} 0"#,
            "ferry_managed_processes 0",
            "ferry_cluster_nodes 2",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        // Without membership there is neither load nor members to show.
        assert!(!text.contains("ferry_node_load"), "{text}");
        assert!(!text.contains("ferry_membership_members"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");

        let (status, _) = http(addr, "GET", "/").await;
        assert!(status.contains(" 404 "), "{status}");
        let (status, _) = http(addr, "POST", "/metrics").await;
        assert!(status.contains(" 405 "), "{status}");

        stop.send(true).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), server)
            .await
            .expect("the server stops on shutdown")
            .unwrap();
    }

    #[test]
    fn unknown_enum_values_get_a_label_not_a_panic() {
        let m = MigrationMetrics::default();
        m.record(&MigrationReport {
            strategy: 99,
            outcome: 42,
            ..Default::default()
        });
        let text = encoded(&m);
        assert!(
            text.contains(
                r#"ferry_migrations_total{strategy="unspecified",outcome="unspecified",sockets="unspecified"} 1"#
            ),
            "{text}"
        );
    }
}
