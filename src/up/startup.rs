//! Start-up and shutdown of `kvpool up`'s children: start them group by group (master, agents,
//! engines, conductor), each group once the one before is ready; print the endpoints; serve
//! until a signal or a child's death; describe an unclean stop. I/O boundary: the children
//! (through [`Children`]), their `/readyz` over HTTP, stdout.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::UpError;
use super::children::{Children, Stopped};
use super::plan::{ChildSpec, Role};

/// Start order: agents need the master, engines need the agents' sockets, the conductor needs
/// the engines.
const GROUPS: [&[Role]; 4] = [
    &[Role::Master],
    &[Role::Agent],
    &[Role::Prefill, Role::Decode],
    &[Role::Conductor],
];

/// Starts every child of `specs`, group by group, waiting up to `timeout` for each group.
pub(super) async fn start_all(
    children: &mut Children,
    specs: &[ChildSpec],
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<(), UpError> {
    for group in GROUPS {
        let members: Vec<&ChildSpec> = specs.iter().filter(|s| group.contains(&s.role)).collect();
        for spec in &members {
            children.start(spec).map_err(UpError::Child)?;
        }
        wait_ready(children, &members, timeout, stop).await?;
    }
    Ok(())
}

async fn wait_ready(
    children: &mut Children,
    specs: &[&ChildSpec],
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<(), UpError> {
    let deadline = Instant::now() + timeout;
    for spec in specs {
        loop {
            if stop.is_cancelled() {
                return Err(UpError::Interrupted);
            }
            if let Some((name, status)) = children.exited() {
                return Err(UpError::ChildExited {
                    log: children.log_path(&name),
                    name,
                    status: status.to_string(),
                });
            }
            let ready = kvpool_harness::http::get_async(spec.admin, spec.ready_path).await;
            if ready.is_some_and(|r| r.status == 200) {
                break;
            }
            if Instant::now() > deadline {
                return Err(UpError::NotReady {
                    name: spec.name.clone(),
                    seconds: timeout.as_secs_f64(),
                    log: children.log_path(&spec.name),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// The service address of the first child of `role`.
pub(super) fn endpoint(specs: &[ChildSpec], role: Role) -> String {
    specs
        .iter()
        .find(|s| s.role == role)
        .and_then(|s| s.endpoint.clone())
        .unwrap_or_default()
}

/// Announces the running pool: one JSON line with `--json` (only without a replay, whose
/// summary is the JSON output), else the endpoints for people.
/// `client_env`: what a client outside `up` needs in its environment (with `--tls`: the CA, a
/// client certificate of its own, transfer TLS).
pub(super) fn print_ready(
    json: bool,
    replay: bool,
    specs: &[ChildSpec],
    dir: &Path,
    client_env: &[(String, String)],
) {
    let conductor = endpoint(specs, Role::Conductor);
    let events = super::plan::pool_events(specs);
    if json && !replay {
        let children: Vec<Value> = specs
            .iter()
            .map(|s| {
                json!({"name": s.name, "role": s.role.as_str(), "endpoint": s.endpoint,
                       "admin": format!("http://{}", s.admin),
                       "kv_events": super::plan::kv_events(s).map(|(e, _)| e)})
            })
            .collect();
        println!(
            "{}",
            json!({"ready": true, "conductor": conductor, "children": children,
                   "master": endpoint(specs, Role::Master),
                   "pool_events": events.as_ref().map(|(e, r)| json!({
                       "endpoint": e, "replay": r, "topic": super::plan::POOL_EVENTS_TOPIC})),
                   "auth_key_file": super::plan::key_file(dir).display().to_string(),
                   "role_key_files": role_files(dir),
                   "client_env": client_env.iter().map(|(k, v)| (k.clone(), Value::from(v.clone()))).collect::<serde_json::Map<_, _>>(),
                   "dir": dir.display().to_string()})
        );
    } else if !json {
        println!("kvpool up: ready");
        println!(
            "  conductor  {conductor}  (OpenAI-compatible: /v1/completions, /v1/chat/completions)"
        );
        for s in specs {
            println!(
                "  {:<10} {}  admin http://{}",
                s.name,
                s.endpoint.as_deref().unwrap_or("-"),
                s.admin
            );
        }
        if let Some((e, r)) = &events {
            println!(
                "  pool events {e}  (vLLM KV events, topic {}; replay {})",
                super::plan::POOL_EVENTS_TOPIC,
                r.as_deref().unwrap_or("-")
            );
        }
        println!("  dir        {}", dir.display());
        let env: String = client_env
            .iter()
            .map(|(k, v)| format!("{k}={v} "))
            .collect();
        println!(
            "  python     {env}KVPOOL_MASTER={} KVPOOL_AUTH_KEY_FILE={} \
             .tools/py/bin/python examples/python_put_get.py",
            endpoint(specs, Role::Master),
            super::plan::role_key_file(dir, kvpool_proto::auth::Role::Engine).display()
        );
    }
}

/// Each role's credential file, by role name.
fn role_files(dir: &Path) -> serde_json::Value {
    use kvpool_proto::auth::Role;
    [Role::Agent, Role::Engine, Role::Conductor, Role::Observer]
        .into_iter()
        .map(|r| {
            let path = super::plan::role_key_file(dir, r).display().to_string();
            (r.name().to_owned(), serde_json::Value::from(path))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Serves until a signal, or until a child dies.
pub(super) async fn serve(children: &mut Children, stop: &CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(500)) => {
                if let Some((name, status)) = children.exited() {
                    tracing::error!(child = %name, %status, "child exited; stopping");
                    break;
                }
            }
        }
    }
}

/// Runs `work` (the replay) while watching the children: when one exits, `cancel` is
/// cancelled so that the work winds down, and its name and exit status are returned with the
/// work's result.
pub(super) async fn watch<T>(
    children: &mut Children,
    work: impl std::future::Future<Output = T>,
    cancel: &CancellationToken,
) -> (T, Option<(String, String)>) {
    tokio::pin!(work);
    let mut died = None;
    loop {
        tokio::select! {
            out = &mut work => return (out, died),
            () = tokio::time::sleep(Duration::from_millis(200)), if died.is_none() => {
                if let Some((name, status)) = children.exited() {
                    tracing::error!(child = %name, %status, "child exited; stopping the replay");
                    died = Some((name, status.to_string()));
                    cancel.cancel();
                }
            }
        }
    }
}

/// What went wrong in the stop, if anything: children that had exited, failed or were killed.
pub(super) fn unclean(stopped: &[Stopped]) -> Option<String> {
    let bad: Vec<String> = stopped
        .iter()
        .filter(|s| !s.clean())
        .map(|s| match (&s.status, s.early) {
            (Some(st), true) => format!("{} had exited ({st})", s.name),
            (Some(st), false) => format!("{} exited {st}", s.name),
            (None, _) => format!("{} was killed", s.name),
        })
        .collect();
    (!bad.is_empty()).then(|| bad.join(", "))
}
