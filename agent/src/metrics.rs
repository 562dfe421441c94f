//! Prometheus metrics: `GET /metrics` on `[metrics] listen`, in the
//! OpenMetrics text format.
//!
//! Two kinds of metric:
//! - migration metrics ([`MigrationMetrics`]), recorded when a migration
//!   this node ran as the source ends (the agent's `store_report`);
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

use ferry_proto::v1::{self as pb, MigrationReport};
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::agent::Agent;

/// Freeze times: a few milliseconds (an idle process) to seconds (large
/// images, thousands of connections).
pub const FREEZE_BUCKETS: &[f64] = &[
    0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];
/// Whole migrations, request to end.
pub const DURATION_BUCKETS: &[f64] = &[
    0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigrationLabels {
    strategy: &'static str,
    outcome: &'static str,
    /// How the TCP connections moved: "collective" or "iterative".
    sockets: &'static str,
}

impl MigrationLabels {
    fn of(report: &MigrationReport) -> Self {
        Self {
            strategy: match pb::Strategy::try_from(report.strategy) {
                Ok(pb::Strategy::TotalCopy) => "total_copy",
                Ok(pb::Strategy::PreCopy) => "pre_copy",
                Ok(pb::Strategy::QueuedPreCopy) => "queued_pre_copy",
                Ok(pb::Strategy::PostCopy) => "post_copy",
                _ => "unspecified",
            },
            outcome: match pb::MigrationOutcome::try_from(report.outcome) {
                Ok(pb::MigrationOutcome::Committed) => "committed",
                Ok(pb::MigrationOutcome::Aborted) => "aborted",
                Ok(pb::MigrationOutcome::Lost) => "lost",
                _ => "unspecified",
            },
            sockets: match pb::SocketMigration::try_from(report.sockets) {
                Ok(pb::SocketMigration::Collective) => "collective",
                Ok(pb::SocketMigration::Iterative) => "iterative",
                Ok(pb::SocketMigration::Incremental) => "incremental",
                _ => "unspecified",
            },
        }
    }
}

type HistogramFamily = Family<MigrationLabels, Histogram, fn() -> Histogram>;

/// What finished migrations add up to. Cheap to clone: the clones share
/// their values (a registry holds one, the agent another).
#[derive(Debug, Clone)]
pub struct MigrationMetrics {
    migrations: Family<MigrationLabels, Counter>,
    freeze: HistogramFamily,
    duration: HistogramFamily,
    transferred: Family<MigrationLabels, Counter>,
    image: Family<MigrationLabels, Counter>,
}

impl Default for MigrationMetrics {
    /// Every strategy and outcome starts at zero, present from the first
    /// scrape on: Prometheus' `rate()` and `increase()` only see a series
    /// grow from a value they scraped.
    fn default() -> Self {
        let m = Self {
            migrations: Family::default(),
            freeze: Family::new_with_constructor(|| Histogram::new(FREEZE_BUCKETS.iter().copied())),
            duration: Family::new_with_constructor(|| {
                Histogram::new(DURATION_BUCKETS.iter().copied())
            }),
            transferred: Family::default(),
            image: Family::default(),
        };
        let outcomes = [
            pb::MigrationOutcome::Committed,
            pb::MigrationOutcome::Aborted,
        ];
        let socket_paths = [
            pb::SocketMigration::Collective,
            pb::SocketMigration::Iterative,
            pb::SocketMigration::Incremental,
        ];
        for (outcome, sockets) in outcomes
            .into_iter()
            .flat_map(|o| socket_paths.map(|s| (o, s)))
        {
            let labels = MigrationLabels::of(&MigrationReport {
                strategy: pb::Strategy::TotalCopy as i32,
                outcome: outcome as i32,
                sockets: sockets as i32,
                ..Default::default()
            });
            let _ = m.migrations.get_or_create(&labels);
            let _ = m.freeze.get_or_create(&labels);
            let _ = m.duration.get_or_create(&labels);
            let _ = m.transferred.get_or_create(&labels);
            let _ = m.image.get_or_create(&labels);
        }
        m
    }
}

impl MigrationMetrics {
    /// Counts a finished migration (this node was its source).
    pub fn record(&self, report: &MigrationReport) {
        let labels = MigrationLabels::of(report);
        self.migrations.get_or_create(&labels).inc();
        // A migration that failed before the freeze has none to count.
        if report.freeze_time_us > 0 {
            self.freeze
                .get_or_create(&labels)
                .observe(report.freeze_time_us as f64 / 1e6);
        }
        self.duration
            .get_or_create(&labels)
            .observe(report.total_time_us as f64 / 1e6);
        self.transferred
            .get_or_create(&labels)
            .inc_by(report.bytes_transferred);
        self.image.get_or_create(&labels).inc_by(report.image_bytes);
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "ferry_migrations",
            "Migrations this node ran as the source, by strategy, outcome and how the TCP \
             connections moved",
            self.migrations.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_freeze",
            "How long the process was stopped: from the freeze on the source to running again \
             (on the destination, or on the source after an abort)",
            Unit::Seconds,
            self.freeze.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_duration",
            "Whole migrations, from the request to the commit or the end of the rollback",
            Unit::Seconds,
            self.duration.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_transferred",
            "Bytes sent to destinations over the peer connection",
            Unit::Bytes,
            self.transferred.clone(),
        );
        registry.register_with_unit(
            "ferry_migration_image",
            "Bytes of checkpoint images dumped",
            Unit::Bytes,
            self.image.clone(),
        );
    }
}

/// The registry `/metrics` encodes: the agent's migration metrics and its
/// state at scrape time. Holds the agent weakly: the HTTP server does not
/// keep it alive.
pub fn registry(agent: &Arc<Agent>) -> Registry {
    let mut registry = Registry::default();
    agent.metrics.register(&mut registry);
    registry.register_collector(Box::new(NodeCollector {
        agent: Arc::downgrade(agent),
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
    agent: Weak<Agent>,
}

impl prometheus_client::collector::Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(agent) = self.agent.upgrade() else {
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
                ("node", agent.node()),
                ("version", env!("CARGO_PKG_VERSION")),
            ];
            info.encode(e.encode_family(&labels)?)?;
        }
        encode_dataplane(&agent, &mut encoder)?;
        gauge(
            &mut encoder,
            "ferry_managed_processes",
            "Processes under this agent's management",
            agent.registry().len() as i64,
        )?;
        gauge(
            &mut encoder,
            "ferry_cluster_nodes",
            "Nodes this agent knows, itself included: configured peers and the live ones \
             membership found",
            agent.known_peers().len() as i64 + 1,
        )?;
        if let Some(conductor) = agent.conductor.get() {
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
        if let Some(membership) = agent.membership.get() {
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
fn encode_dataplane(agent: &Agent, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let (c, totals) = match agent.data_plane_counters() {
        Ok(v) => v,
        Err(e) => {
            // The rest of the scrape is still worth having.
            tracing::warn!(error = %e, "reading the data plane's counters for /metrics");
            return Ok(());
        }
    };
    let translation = match agent.flows().counters() {
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
        let agent = Agent::new(
            config,
            Box::new(crate::ownership::fake::FakeFilter::default()),
            Box::new(crate::capture::fake::FakeReplayer::default()),
            Box::new(crate::translation::fake::FakeFlowRules::default()),
        );
        // The hook every finished source migration goes through.
        agent.store_report(report(pb::MigrationOutcome::Committed, 30_000));

        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve(listener, registry(&agent), stopped));

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
