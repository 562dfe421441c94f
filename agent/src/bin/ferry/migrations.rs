//! The commands about migrations: `ferry migrate` (live progress, then the
//! report), `report` and `cancel`.

use anyhow::{Result, bail};
use ferry_proto::v1::{self as pb, GetMigrationRequest, MigrateRequest, migration_event};

use crate::args::{MigrateArgs, sockets_arg, strategy_arg};
use crate::connection::{Client, status_error};
use crate::output::print_report;
use crate::progress;

pub(crate) async fn migrate(
    client: &mut Client,
    node: String,
    args: MigrateArgs,
    as_json: bool,
) -> Result<()> {
    let MigrateArgs {
        pid,
        to,
        sockets,
        strategy,
        downtime_budget_ms,
        max_rounds,
        throttle,
        drain_ms,
    } = args;
    let throttle = match throttle.as_deref() {
        Some("auto") => pb::PrecopyThrottle::Auto,
        Some("off") => pb::PrecopyThrottle::Off,
        _ => pb::PrecopyThrottle::Unspecified,
    };
    let sockets = sockets_arg(sockets.as_deref());
    let strategy = strategy_arg(strategy.as_deref());
    let mut stream = client
        .migrate(MigrateRequest {
            pid,
            destination_node: to,
            strategy: strategy as i32,
            sockets: sockets as i32,
            downtime_budget_ms: downtime_budget_ms.unwrap_or(0),
            max_rounds: max_rounds.unwrap_or(0),
            throttle: throttle as i32,
            source_node: node,
            drain_send_queues_ms: drain_ms.unwrap_or(0),
        })
        .await
        .map_err(status_error)?
        .into_inner();
    let mut report = None;
    let mut progress = progress::Line::new(!as_json);
    loop {
        match stream.message().await {
            Ok(Some(ev)) => match ev.event {
                Some(migration_event::Event::Started(s)) => progress.note(&format!(
                    "migration {} of PID {}: {} -> {}",
                    s.migration_id, s.pid, s.source_node, s.destination_node
                )),
                Some(migration_event::Event::Progress(p)) => progress.phase(&p),
                Some(migration_event::Event::Report(r)) => report = Some(r),
                None => {}
            },
            Ok(None) => break,
            Err(s) => {
                progress.done();
                if let Some(r) = &report {
                    print_report(r, as_json)?;
                }
                return Err(status_error(s));
            }
        }
    }
    progress.done();
    match report {
        Some(r) => print_report(&r, as_json),
        None => bail!("the agent ended the migration stream without a report"),
    }
}

pub(crate) async fn report(
    client: &mut Client,
    node: String,
    migration_id: String,
    as_json: bool,
) -> Result<()> {
    let r = client
        .get_migration(GetMigrationRequest { migration_id, node })
        .await
        .map_err(status_error)?
        .into_inner();
    print_report(&r, as_json)
}

pub(crate) async fn cancel(
    client: &mut Client,
    node: String,
    migration_id: String,
    as_json: bool,
) -> Result<()> {
    let r = client
        .cancel_migration(pb::CancelMigrationRequest { migration_id, node })
        .await
        .map_err(status_error)?
        .into_inner();
    print_report(&r, as_json)
}
