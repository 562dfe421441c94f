//! The migrations (and pauses) of one cluster, and the other servers beside them.

use super::*;

/// How long the `pause` mode stops the server: `--pause-ms`, or the median
/// freeze of the incremental migrations measured so far in `scenario`,
/// else of any mode's, 100 ms before the first.
pub(crate) fn pause_length(args: &Args, rows: &[Row], scenario: Scenario) -> Duration {
    if args.pause_ms > 0 {
        return Duration::from_millis(args.pause_ms);
    }
    let measured = |mode: fn(&str) -> bool| -> Vec<f64> {
        rows.iter()
            .filter(|r| r.tcp == scenario.tcp && r.udp == scenario.udp && mode(r.mode))
            .map(|r| r.freeze_ms)
            .collect()
    };
    let mut freezes = measured(|m| m == "incremental");
    if freezes.is_empty() {
        freezes = measured(|m| m != PAUSE);
    }
    if freezes.is_empty() {
        Duration::from_millis(100)
    } else {
        Duration::from_secs_f64(median_unsorted(&freezes) / 1e3)
    }
}

/// Stops the server where it runs for `length` (SIGSTOP, SIGCONT): what a
/// freeze of that length costs the clients without a migration. The
/// report holds only the freeze, as measured here.
pub(crate) async fn pause(pid: i32, length: Duration) -> Result<MigrationReport> {
    let signal = |sig: libc::c_int| {
        // SAFETY: kill(2) takes plain integers; `pid` is the bench's own
        // server, run through the agent on this machine.
        if unsafe { libc::kill(pid, sig) } != 0 {
            bail!(
                "signal {sig} to the server {pid}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    };
    let started = std::time::Instant::now();
    signal(libc::SIGSTOP)?;
    tokio::time::sleep(length).await;
    signal(libc::SIGCONT)?;
    Ok(MigrationReport {
        freeze_time_us: started.elapsed().as_micros() as u64,
        ..Default::default()
    })
}

pub(crate) fn part(report: &MigrationReport, prefix: &str) -> f64 {
    report
        .freeze_parts
        .iter()
        .filter(|p| p.phase.starts_with(prefix))
        .fold(0.0, |sum, p| sum + p.duration_us as f64 / 1e3)
}

/// What one cluster of the sweep serves.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scenario {
    /// DVE clients (0: a UDP-only server).
    pub(crate) tcp: usize,
    pub(crate) udp: usize,
    /// The PostgreSQL server the DVE server holds a session to.
    pub(crate) db: Option<std::net::SocketAddr>,
}

pub(crate) async fn migrations(
    cluster: &Cluster,
    scenario: Scenario,
    modes: &[(&'static str, SocketMigration)],
    args: &Args,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let Scenario {
        tcp: tcp_count,
        udp: udp_count,
        db,
    } = scenario;
    let nodes = ["node1", "node2"];
    let mut here = 0;
    let mut control = cluster.control(nodes[here]).await?;
    let mut server = vec![
        ferry_integration::bin_path("ferry-dve-server")
            .display()
            .to_string(),
        "--port".into(),
        PORT.to_string(),
    ];
    let session_target = SocketAddrV4::new(cluster.public_addr(), SESSION_PORT);
    if let Some(db) = db {
        server.extend([
            "--".into(),
            ferry_integration::bin_path("ferry-pg-session")
                .display()
                .to_string(),
            "--pg".into(),
            db.to_string(),
            "--serve".into(),
            session_target.to_string(),
            "--interval-ms".into(),
            "50".into(),
        ]);
    }
    let listening = if db.is_some() { 2 } else { 1 };
    let mut pid = run(&mut control, server).await;
    // Its UDP port claimed too: until then no node takes the players'
    // datagrams, which would count as lost.
    wait_for_process(&mut control, pid, |p| {
        p.tcp_listening == listening && p.udp_sockets >= 1
    })
    .await;
    let target = SocketAddrV4::new(cluster.public_addr(), PORT);
    let clients = [cluster.netns_path("client1"), cluster.netns_path("client2")];
    let session_ok = |s: &SessionStatus, first: &SessionStatus| -> Result<()> {
        if s.backend_pid != first.backend_pid || s.queries_failed != 0 || s.last_error.is_some() {
            bail!("the database session did not survive: {s:?} (first {first:?})");
        }
        Ok(())
    };
    let session_first = match db {
        Some(_) => Some(
            wait_for_queries(&clients[0], session_target, 0, 5, Duration::from_secs(30))
                .map_err(anyhow::Error::msg)?,
        ),
        None => None,
    };
    let bystanders = if args.bystanders > 0 && tcp_count > 0 {
        Some(Bystanders::start(cluster, &nodes, &clients[1], args.bystanders).await?)
    } else {
        None
    };
    for run in 0..args.runs {
        // The server moves node1 -> node2 -> node1 ...: with an even number
        // of modes in a fixed order, each mode would always move the same
        // way. Every other run takes them in reverse, so each mode moves
        // both ways.
        let order: Vec<_> = if run % 2 == 1 && modes.len().is_multiple_of(2) {
            modes.iter().rev().copied().collect()
        } else {
            modes.to_vec()
        };
        for (mode_name, mode) in order {
            let tcp = (tcp_count > 0)
                .then(|| SeqClient::start(clients[0].clone(), target, tcp_count, INTERVAL, 256))
                .transpose()?;
            let udp = UdpClients::start(clients[1].clone(), target, udp_count, INTERVAL, 96)?;
            let bulk = (args.bulk > 0 && tcp_count > 0)
                .then(|| {
                    SeqClient::start(clients[1].clone(), target, args.bulk, Duration::ZERO, 16384)
                })
                .transpose()?;
            if let Some(tcp) = &tcp {
                tcp.wait_until_flowing(Duration::from_secs(30))?;
            }
            if let Some(b) = &bulk {
                b.wait_until_flowing(Duration::from_secs(30))?;
            }
            let bulk_before = bulk.as_ref().map(|b| b.verified_per_connection());
            udp.wait_for_echoes(udp_count as u64 * 10, Duration::from_secs(10))
                .map_err(anyhow::Error::msg)?;
            let before = Nstat::read(&clients[0])?;
            let drops_before = backlog_drops()?;
            let tcp_before = tcp.as_ref().map(|t| t.verified_per_connection());
            let session_before = match &session_first {
                Some(first) => {
                    let s = wait_for_queries(
                        &clients[0],
                        session_target,
                        0,
                        1,
                        Duration::from_secs(10),
                    )
                    .map_err(anyhow::Error::msg)?;
                    session_ok(&s, first)?;
                    Some(s)
                }
                None => None,
            };

            let report = if mode_name == PAUSE {
                let length = pause_length(args, rows, scenario);
                pause(pid, length).await?
            } else {
                let to = nodes[1 - here];
                let (report, status) = migrate_request(
                    &mut control,
                    MigrateRequest {
                        pid,
                        destination_node: to.into(),
                        strategy: args.strategy.to_pb() as i32,
                        sockets: mode as i32,
                        drain_send_queues_ms: args.drain_ms,
                        ..Default::default()
                    },
                )
                .await
                .context("starting the migration")?;
                if status.is_some() || report.outcome != MigrationOutcome::Committed as i32 {
                    bail!(
                        "{tcp_count} connections, {mode_name}, run {run}: migration failed: {status:?} {}",
                        report.error
                    );
                }
                if report.sockets != mode as i32 {
                    bail!(
                        "{tcp_count} connections, run {run}: asked for {mode_name}, got {} ({})",
                        report.sockets,
                        report.sockets_note
                    );
                }
                here = 1 - here;
                pid = report.destination_pid;
                control = cluster.control(nodes[here]).await?;
                wait_for_process(&mut control, pid, |p| p.state == "running").await;
                report
            };

            if let (Some(tcp), Some(before)) = (&tcp, &tcp_before) {
                tcp.wait_until_each_passes(before, 20, Duration::from_secs(30))?;
            }
            if let (Some(first), Some(before)) = (&session_first, &session_before) {
                let s = wait_for_queries(
                    &clients[0],
                    session_target,
                    before.queries_ok,
                    5,
                    Duration::from_secs(30),
                )
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{tcp_count} connections, {mode_name}, run {run}"))?;
                session_ok(&s, first)?;
            }
            if let (Some(b), Some(before)) = (&bulk, &bulk_before) {
                b.wait_until_each_passes(before, 200, Duration::from_secs(30))?;
            }
            let seen = udp.echoed();
            udp.wait_for_echoes(seen + udp_count as u64 * 20, Duration::from_secs(30))
                .map_err(anyhow::Error::msg)?;
            let after = Nstat::read(&clients[0])?;
            let drops = backlog_drops()?.saturating_sub(drops_before);
            let tcp_report = tcp.map(|t| t.stop());
            if let Some(b) = bulk {
                let r = b.stop();
                if !r.failures().is_empty() {
                    bail!(
                        "{tcp_count} connections, {mode_name}, run {run}: bulk streams failed: {:?}",
                        r.failures()
                    );
                }
            }
            let udp_report = udp.stop()?;
            if let Some(r) = &tcp_report
                && !r.failures().is_empty()
            {
                bail!(
                    "{tcp_count} connections, {mode_name}, run {run}: TCP streams failed: {:?}",
                    r.failures()
                );
            }
            let mut gaps: Vec<f64> = tcp_report
                .iter()
                .flat_map(|r| &r.connections)
                .filter_map(|c| c.max_gap.as_ref())
                .map(|g| g.duration.as_secs_f64() * 1e3)
                .collect();
            gaps.sort_by(f64::total_cmp);
            let interval_ms = INTERVAL.as_secs_f64() * 1e3;
            let beyond: Vec<f64> = gaps.iter().map(|g| (g - interval_ms).max(0.0)).collect();
            let replay = report.replay.unwrap_or_default();
            let row = Row {
                tcp: tcp_count,
                udp: udp_count,
                mode: mode_name,
                run,
                freeze_ms: report.freeze_time_us as f64 / 1e3,
                dump_ms: part(&report, "dump"),
                transfer_ms: part(&report, "transfer"),
                restore_ms: part(&report, "restore"),
                replay_ms: part(&report, "commit: replay"),
                frozen_bytes: report.bytes_transferred,
                image_files: report.image_files,
                gap_median_ms: median(&gaps),
                gap_max_ms: gaps
                    .last()
                    .copied()
                    .unwrap_or(0.0)
                    .max(udp_report.max_gap().as_secs_f64() * 1e3),
                rtos: after.since(&before).get("TcpExtTCPTimeouts")?,
                udp_lost: udp_report.lost(),
                drain_ms: report.drain_time_us as f64 / 1e3,
                drain_start: report.drain_bytes_at_start,
                drain_left: report.drain_bytes_left,
                send_queues: report.tcp_send_queue_bytes,
                backlog_drops: drops,
                gap_beyond_median_ms: median(&beyond),
                gap_beyond_p99_ms: percentile(&beyond, 99.0),
                replay_duration_ms: replay.replay_time_us as f64 / 1e3,
                replayed: replay.replayed,
                replay_backlog_drops: replay.input_backlog_drops,
                parts: report
                    .freeze_parts
                    .iter()
                    .map(|p| (p.phase.clone(), p.duration_us as f64 / 1e3))
                    .collect(),
            };
            println!("{}", row.cells().join("\t"));
            rows.push(row);
        }
    }
    if let Some(b) = bystanders {
        b.stop()?;
    }
    Ok(())
}

/// Other processes' connections on the migrating server's nodes: an echo
/// server on each of node1 and node2 (never migrated; a thread per
/// connection, so that idle connections cost no CPU, unlike the DVE
/// server's poll over all of them) and idle clients.
pub(crate) struct Bystanders {
    pub(crate) clients: Vec<SeqClient>,
}

impl Bystanders {
    async fn start(
        cluster: &Cluster,
        nodes: &[&str; 2],
        netns: &std::path::Path,
        each: usize,
    ) -> Result<Self> {
        let mut clients = Vec::new();
        for (node, port) in nodes.iter().zip(BYSTANDER_PORTS) {
            let mut control = cluster.control(node).await?;
            let server = vec![
                ferry_integration::bin_path("ferry-echo-server")
                    .display()
                    .to_string(),
                "--port".into(),
                port.to_string(),
            ];
            let pid = run(&mut control, server).await;
            wait_for_process(&mut control, pid, |p| p.tcp_listening == 1).await;
            let target = SocketAddrV4::new(cluster.public_addr(), port);
            let c = SeqClient::start(netns, target, each, BYSTANDER_INTERVAL, 64)
                .with_context(|| format!("{each} bystander connections to {node}"))?;
            c.wait_until_flowing(Duration::from_secs(30))?;
            clients.push(c);
        }
        println!(
            "bystanders: {each} established connections of another server on each of {}",
            nodes.join(" and ")
        );
        Ok(Self { clients })
    }

    /// Every bystander connection carried every byte, untouched by the
    /// migrations beside it.
    fn stop(self) -> Result<()> {
        for c in self.clients {
            let r = c.stop();
            if !r.failures().is_empty() {
                bail!("bystander connections failed: {:?}", r.failures());
            }
        }
        Ok(())
    }
}
