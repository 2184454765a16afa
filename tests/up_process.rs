//! `kvpool up` as a real process: a trace replay through master, agent, engines and conductor
//! (summary checked, every child gone afterwards), SIGTERM without a replay, a start-up
//! failure halfway that must not leave the already started children running, a child dying or
//! a signal during a replay (non-zero exit), and the private working directory (0700, key
//! 0600) with stale ones of killed runs removed.
//!
//! Children are found by an environment variable that only this test's `kvpool up` (and so its
//! children) carries.

mod pool_support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvpool_harness::{ChildProcess, Launcher};
use nix::sys::signal::Signal;
use serde_json::Value;

const MARKER: &str = "KVPOOL_UP_TEST_MARKER";
/// Only a hang reaches it on a loaded 2-core box.
const DEADLINE: Duration = Duration::from_secs(240);

/// Processes (not zombies) whose environment has `MARKER=<marker>`.
fn marked(marker: &str) -> Vec<u32> {
    let needle = format!("{MARKER}={marker}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|kv| kv == needle.as_bytes()))
                && pool_support::alive(pid)
        })
        .collect()
}

fn up(dir: &Path, marker: &str, sysfs_root: &Path) -> Command {
    let mut cmd = up_in_temp(marker, sysfs_root);
    cmd.arg("--dir").arg(dir);
    cmd
}

/// `kvpool up` with its working directory left to it (a temporary one).
fn up_in_temp(marker: &str, sysfs_root: &Path) -> Command {
    let fixture = pool_support::sysfs_fixture();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpool"));
    cmd.arg("up")
        .args(["--agents", "1", "--prefill", "1", "--decode", "1"])
        .arg("--agent-sysfs-root")
        .arg(sysfs_root)
        .arg("--agent-procfs-root")
        .arg(fixture.join("proc"))
        .env(MARKER, marker);
    cmd
}

fn wait_exit(child: &mut ChildProcess) -> std::process::ExitStatus {
    child.wait_timeout(DEADLINE).expect("kvpool up exits")
}

/// `kvpool up` with its stdout piped to the test and its stderr in `<dir>/up.log`.
fn spawn_up(dir: &Path, cmd: &mut Command) -> ChildProcess {
    Launcher::new(dir)
        .pipe_stdout()
        .spawn("up", cmd)
        .expect("spawn kvpool up")
}

fn marker(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

#[test]
fn replay_moves_kv_blocks_through_the_agent_and_leaves_no_child() {
    let summary = replay_excerpt("replay", &[]);
    // The conductor learnt the pool's fetch bandwidth or kept the configured one; either way
    // it reports a figure, and nothing waited for an SGLang room.
    assert!(
        summary["timing"]["conductor_fetch_bandwidth_bytes_per_s"]
            .as_f64()
            .is_some(),
        "{summary}"
    );
    assert_eq!(summary["timing"]["handoff_wait"]["count"], 0.0, "{summary}");
}

#[test]
fn sglang_replay_hands_kv_over_through_the_pool_by_room() {
    let summary = replay_excerpt("sglang", &["--engine-protocol", "sglang"]);
    // Every served request's decode half waited for its room and found it.
    let waits = summary["timing"]["handoff_wait"]["count"]
        .as_f64()
        .unwrap_or(0.0);
    assert_eq!(
        Some(waits),
        summary["served"].as_f64(),
        "one hand-off per served request: {summary}"
    );
}

/// `--tls`: the master serves over TLS with a throw-away certificate, and every client of it
/// (the agent, the conductor, `up`'s own summary) verifies it with the run's CA: the replay's
/// checks pass, and the pool's figures come from the master over TLS.
#[test]
fn tls_replay_reaches_the_master_over_tls_from_every_child() {
    let dir = tempfile::tempdir().expect("tempdir");
    let summary = replay_excerpt_in(&dir, "tls", &["--tls"]);
    assert!(summary["pool"]["objects"].as_u64().is_some(), "{summary}");
    // The master did serve TLS (so every child that reached it spoke TLS), and the keys are
    // private to the user.
    let log = std::fs::read_to_string(dir.path().join("logs/master.log")).expect("master log");
    assert!(log.contains("tls=true"), "{log}");
    // Mutual TLS with a certificate per process: the master requires client certificates,
    // and every child (and `up` itself) has its own key, private to the user.
    assert!(log.contains("mutual_tls=true"), "{log}");
    assert_eq!(mode(&dir.path().join("tls-master-key.pem")), 0o600);
    let mut keys = Vec::new();
    for child in ["up", "agent-0", "conductor", "prefill-0", "decode-0"] {
        let key = dir.path().join(format!("tls-{child}-key.pem"));
        assert_eq!(mode(&key), 0o600, "{child}");
        keys.push(std::fs::read(&key).expect("key"));
    }
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 5, "every process has a key of its own");
}

/// `kvpool up` on the agents' fixture machine.
fn up_on_fixture(dir: &Path, marker: &str) -> Command {
    up(dir, marker, &pool_support::sysfs_fixture().join("sys"))
}

/// Replays the first 6 records of the test excerpt through `kvpool up` with `extra` flags and
/// checks what every mode must show; returns the summary.
fn replay_excerpt(name: &str, extra: &[&str]) -> Value {
    let dir = tempfile::tempdir().expect("tempdir");
    replay_excerpt_in(&dir, name, extra)
}

/// [`replay_excerpt`] in the working directory `dir` (kept for the caller to look into).
fn replay_excerpt_in(dir: &tempfile::TempDir, name: &str, extra: &[&str]) -> Value {
    let marker = marker(name);
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/conversation_excerpt.jsonl");
    let mut child = spawn_up(
        dir.path(),
        up_on_fixture(dir.path(), &marker)
            .arg("--replay")
            .arg(&trace)
            .args(["--limit", "6", "--speed", "20", "--json"])
            .args(extra),
    );
    let mut out = String::new();
    use std::io::Read;
    if let Some(mut s) = child.take_stdout() {
        s.read_to_string(&mut out).expect("stdout");
    }
    let status = wait_exit(&mut child);
    let err = child.log_text();
    assert!(status.success(), "{status}\nstdout:\n{out}\nstderr:\n{err}");
    let summary: Value = serde_json::from_str(out.trim()).expect("summary is one JSON object");
    assert_eq!(summary["requests"], 6, "{summary}");
    assert!(summary["served"].as_u64().unwrap_or(0) > 0, "{summary}");
    let engines = &summary["engines"];
    // The excerpt's prompts are several 512-token blocks long: written by prefill, read back by
    // decode (one agent, so every hand-off is local) and verified.
    assert!(
        engines["kv_written_bytes"].as_f64().unwrap_or(0.0) > 0.0,
        "{summary}"
    );
    assert!(
        engines["kv_read_bytes"].as_f64().unwrap_or(0.0) > 0.0,
        "{summary}"
    );
    assert!(
        engines["kv_block_hits"].as_f64().unwrap_or(0.0) > 0.0,
        "{summary}"
    );
    assert_eq!(engines["kv_verify_failures"], 0.0, "{summary}");
    // The conductor's index followed the prefill engines' own KV events (vLLM's wire format
    // over ZMQ), not only its guesses.
    assert!(
        summary["conductor_kv_events"]["blocks_stored"]
            .as_f64()
            .unwrap_or(0.0)
            > 0.0,
        "{summary}"
    );
    assert_eq!(summary["pool"]["nodes_alive"], 1, "{summary}");
    assert_eq!(summary["clean_shutdown"], true, "{summary}");
    assert!(summary["ttft_ms"]["p50"].as_f64().is_some(), "{summary}");
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
    summary
}

#[test]
fn sigterm_stops_every_child_and_exits_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = marker("sigterm");
    let mut child = spawn_up(dir.path(), &mut up_on_fixture(dir.path(), &marker));
    let stdout = child.take_stdout().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut printed = Vec::new();
    // `up` prints its endpoints once every child is ready, then the Ctrl-C hint.
    loop {
        match lines.next() {
            Some(Ok(line)) => {
                let done = line.starts_with("press Ctrl-C");
                printed.push(line);
                if done {
                    break;
                }
            }
            _ => panic!("kvpool up ended before it was ready: {printed:?}"),
        }
    }
    let conductor = printed
        .iter()
        .find(|l| l.trim_start().starts_with("conductor"))
        .expect("conductor line");
    assert!(conductor.contains("http://127.0.0.1:"), "{printed:?}");
    // master, agent, prefill, decode, conductor.
    let running = marked(&marker);
    assert_eq!(running.len(), 6, "up and its 5 children: {running:?}");
    child.signal(Signal::SIGTERM).expect("SIGTERM");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = wait_exit(&mut child);
    assert!(status.success(), "{status}: {rest:?}");
    assert!(rest.iter().any(|l| l == "all children stopped"), "{rest:?}");
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
}

#[test]
fn a_child_failing_at_start_stops_the_ones_already_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = marker("fail");
    // An agent whose sysfs root does not exist exits at once: the master is already running by
    // then.
    let out = up(dir.path(), &marker, Path::new("/nonexistent-sysfs"))
        .output()
        .expect("run kvpool up");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("agent-0 exited during start-up"), "{err}");
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
    let log = std::fs::read_to_string(dir.path().join("logs/agent-0.log")).expect("agent log");
    assert!(
        log.contains("sysfs root /nonexistent-sysfs is not readable"),
        "{log}"
    );
}

#[test]
fn children_go_away_when_up_itself_is_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = marker("sigkill");
    let mut child = spawn_up(dir.path(), up_on_fixture(dir.path(), &marker).arg("--json"));
    let stdout = child.take_stdout().expect("stdout");
    let first = BufReader::new(stdout)
        .lines()
        .next()
        .and_then(Result::ok)
        .expect("kvpool up printed nothing");
    let ready: Value = serde_json::from_str(&first).expect("ready line is JSON");
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(
        ready["children"].as_array().map(Vec::len),
        Some(5),
        "{ready}"
    );
    assert_eq!(marked(&marker).len(), 6);
    // The master publishes the pool's block events (vLLM's KV event format) where it says.
    let events = ready["pool_events"]["endpoint"]
        .as_str()
        .expect("pool_events");
    let events = events.strip_prefix("tcp://").expect("a tcp endpoint");
    std::net::TcpStream::connect(events).expect("the master's event publisher listens");
    assert_eq!(ready["pool_events"]["topic"], "kvpool", "{ready}");
    // No chance to clean up: the children's parent-death signal must stop them.
    child.kill().expect("SIGKILL");
    let start = Instant::now();
    while !marked(&marker).is_empty() {
        assert!(start.elapsed() < DEADLINE, "orphans: {:?}", marked(&marker));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Permission bits of `path`.
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn the_temporary_dir_is_private_and_stale_ones_of_killed_runs_are_removed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let logs = tempfile::tempdir().expect("tempdir");
    // The pid of a process that has exited and been reaped.
    let mut gone = Command::new("true").spawn().expect("spawn true");
    let dead = gone.id();
    gone.wait().expect("wait for true");
    let make = |name: &str, pid: Option<u32>| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).expect("mkdir");
        if let Some(p) = pid {
            std::fs::write(d.join("up.pid"), p.to_string()).expect("pid file");
        }
        d
    };
    let stale = make("kvpool-up-stale", Some(dead));
    let live = make("kvpool-up-live", Some(std::process::id()));
    let no_pid = make("kvpool-up-nopid", None);
    let other = make("other-dead", Some(dead));
    let marker = marker("tmpdir");
    let fixture = pool_support::sysfs_fixture().join("sys");
    let mut cmd = up_in_temp(&marker, &fixture);
    cmd.arg("--json").env("TMPDIR", tmp.path());
    let mut child = spawn_up(logs.path(), &mut cmd);
    let stdout = child.take_stdout().expect("stdout");
    let first = BufReader::new(stdout)
        .lines()
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("kvpool up printed nothing: {}", child.log_text()));
    let ready: Value = serde_json::from_str(&first).expect("ready line is JSON");
    let dir = Path::new(ready["dir"].as_str().expect("dir")).to_owned();
    let key = Path::new(ready["auth_key_file"].as_str().expect("key")).to_owned();
    assert!(dir.starts_with(tmp.path()), "{ready}");
    assert_eq!(mode(&dir), 0o700, "working directory");
    assert_eq!(mode(&key), 0o600, "key file");
    assert_eq!(
        std::fs::read_to_string(dir.join("up.pid")).expect("up.pid"),
        child.id().to_string()
    );
    // Only the directory of a dead `up` went; a live one's, one without a pid file and
    // anything not named like ours stayed.
    assert!(!stale.exists(), "stale directory kept");
    for kept in [&live, &no_pid, &other] {
        assert!(kept.exists(), "{} removed", kept.display());
    }
    child.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = wait_exit(&mut child);
    assert!(status.success(), "{status}: {}", child.log_text());
    assert!(!dir.exists(), "the temporary directory outlived up");
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
}

/// `kvpool up` replaying the test excerpt's first 20 records at a hundredth of their speed
/// (engines without timers): the first 10 arrive at once, the 11th only after 300 s, so the
/// replay is certainly still running when the test acts. Returns the process once it is ready.
fn long_replay(dir: &Path, marker: &str) -> ChildProcess {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/conversation_excerpt.jsonl");
    let mut child = spawn_up(
        dir,
        up_on_fixture(dir, marker)
            .arg("--replay")
            .arg(&trace)
            .args(["--limit", "20", "--speed", "0.01", "--time-scale", "0"]),
    );
    let stdout = child.take_stdout().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    // The ready block ends with the Python example's line.
    loop {
        match lines.next() {
            Some(Ok(line)) if line.trim_start().starts_with("python") => break,
            Some(Ok(_)) => {}
            _ => panic!("kvpool up ended before it was ready: {}", child.log_text()),
        }
    }
    // The rest of stdout is drained so that the summary never blocks on a full pipe.
    std::thread::spawn(move || lines.map_while(Result::ok).count());
    child
}

/// The marked process whose command line is `kvpool <role> ...`.
fn child_with_role(marker: &str, role: &str) -> u32 {
    marked(marker)
        .into_iter()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).nth(1) == Some(role.as_bytes()))
        })
        .unwrap_or_else(|| panic!("no {role} process"))
}

#[test]
fn a_child_dying_stops_the_replay_and_up_fails_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = marker("childdies");
    let mut child = long_replay(dir.path(), &marker);
    let master = child_with_role(&marker, "master");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(master as i32), Signal::SIGKILL)
        .expect("kill the master");
    let status = wait_exit(&mut child);
    let err = child.log_text();
    assert!(!status.success(), "{status}: {err}");
    assert!(
        err.contains("master exited during the replay"),
        "the error names the child: {err}"
    );
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
}

#[test]
fn a_signal_during_the_replay_cuts_it_short_and_up_exits_non_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = marker("replaycut");
    let mut child = long_replay(dir.path(), &marker);
    child.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = wait_exit(&mut child);
    let err = child.log_text();
    assert!(!status.success(), "{status}: {err}");
    assert!(
        err.contains("the replay was cut short by a signal") && err.contains("of 20 requests"),
        "{err}"
    );
    // Not a terminal: no progress line was drawn into the log.
    assert!(!err.contains('\r') && !err.contains("requests ("), "{err}");
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
}

#[test]
fn a_replay_on_a_terminal_draws_its_progress_then_the_summary_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = marker("pty");
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/conversation_excerpt.jsonl");
    let cmd = up_on_fixture(dir.path(), &marker);
    let mut line: Vec<String> = vec![cmd.get_program().to_string_lossy().into_owned()];
    line.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    line.extend(
        [
            "--replay",
            trace.to_str().expect("utf-8 path"),
            "--limit",
            "6",
            "--speed",
            "20",
            "--time-scale",
            "0",
        ]
        .map(String::from),
    );
    let typescript = dir.path().join("typescript");
    // util-linux `script` runs it on a pseudo-terminal (stdout and stderr both terminals).
    let out = Command::new("script")
        .args(["-qec", &line.join(" ")])
        .arg(&typescript)
        .env(MARKER, &marker)
        .env_remove("NO_COLOR")
        .output()
        .expect("run script (util-linux)");
    let seen = std::fs::read_to_string(&typescript).unwrap_or_default();
    assert!(out.status.success(), "{}\n{seen}", out.status);
    assert!(
        seen.contains("replay 6/6 requests ("),
        "no progress line: {seen}"
    );
    assert!(seen.contains("replay summary"), "{seen}");
    assert!(seen.contains("  requests     6 in "), "{seen}");
    assert_eq!(marked(&marker), Vec::<u32>::new(), "children left running");
}
