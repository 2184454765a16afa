//! The harness's child processes with `sh` as the child: exits are detected and reported with
//! the log's tail, a hanging child is killed after the grace period, readiness and log waits
//! time out naming what they waited for, and a dropped child leaves no process behind.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use kvpool_harness::{ChildProcess, HarnessError, Launcher, Probe, free_addr};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

fn sh(launcher: &Launcher, name: &str, script: &str) -> ChildProcess {
    launcher
        .spawn(name, Command::new("sh").args(["-c", script]))
        .expect("spawn sh")
}

fn gone(pid: u32) -> bool {
    let pid = Pid::from_raw(i32::try_from(pid).expect("pid"));
    kill(pid, None) == Err(nix::errno::Errno::ESRCH)
}

#[test]
fn an_early_exit_is_reported_with_the_tail_of_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let launcher = Launcher::new(dir.path().join("logs"));
    let mut p = sh(
        &launcher,
        "quitter",
        "for i in $(seq 1 30); do echo line $i; done; echo oops >&2; exit 3",
    );
    let status = p.wait_timeout(Duration::from_secs(30)).expect("exits");
    assert_eq!(status.code(), Some(3));
    let err = p.assert_running().expect_err("it exited");
    assert_eq!(err.category(), "exited");
    let text = err.to_string();
    assert!(text.starts_with("quitter exited early"), "{text}");
    assert!(text.contains("quitter.log"), "{text}");
    assert!(
        text.ends_with("line 30\noops"),
        "stdout and stderr in the log: {text}"
    );
    assert!(!text.contains("line 10\n"), "only the last lines: {text}");
    // Debug shows the same text (what `expect` prints in a test).
    assert_eq!(format!("{err:?}"), text);
    assert_eq!(launcher.log_path("quitter"), p.log_path());
}

#[test]
fn stop_terms_a_polite_child_and_kills_a_stubborn_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let launcher = Launcher::new(dir.path());
    let mut polite = sh(
        &launcher,
        "polite",
        "trap 'exit 0' TERM; echo armed; while :; do sleep 0.05; done",
    );
    let mut stubborn = sh(
        &launcher,
        "stubborn",
        "trap '' TERM; echo armed; while :; do sleep 0.05; done",
    );
    for p in [&mut polite, &mut stubborn] {
        p.wait_for_log_line("the trap", Duration::from_secs(30), |l| l == "armed")
            .expect("trap installed");
    }
    let started = Instant::now();
    let s = stubborn.stop(Duration::from_millis(300));
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!((s.status, s.early), (None, false), "killed: {s:?}");
    assert!(!s.clean());
    let p = polite.stop(Duration::from_secs(30));
    assert!(p.clean(), "{p:?}");
    assert!(gone(polite.id()) && gone(stubborn.id()), "both reaped");
    // A child that had exited already is reported as early.
    let mut quick = sh(&launcher, "quick", "exit 0");
    quick.wait_timeout(Duration::from_secs(30)).expect("exits");
    assert!(quick.stop(Duration::from_secs(1)).early);
}

#[test]
fn readiness_and_log_waits_time_out_naming_what_they_waited_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let launcher = Launcher::new(dir.path());
    let mut p = sh(&launcher, "sleeper", "echo started; sleep 30");
    let nobody = free_addr().expect("port");
    let err = p
        .wait_ready(&Probe::Tcp(nobody), Duration::from_millis(300))
        .expect_err("nothing listens");
    assert!(matches!(err, HarnessError::NotReady { .. }), "{err}");
    assert!(err.to_string().contains(&nobody.to_string()), "{err}");
    let err = p
        .wait_for_log_line("the word ready", Duration::from_millis(300), |l| {
            l == "ready"
        })
        .expect_err("never logged");
    assert!(err.to_string().contains("the word ready"), "{err}");
    assert!(err.to_string().ends_with("started"), "the tail: {err}");
    // A listener makes the probe succeed; a child that dies while waited on fails at once.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    p.wait_ready(&Probe::Tcp(addr), Duration::from_secs(30))
        .expect("ready");
    let mut dying = sh(&launcher, "dying", "exit 7");
    let started = Instant::now();
    let err = dying
        .wait_ready(&Probe::Tcp(nobody), Duration::from_secs(60))
        .expect_err("exited");
    assert_eq!(err.category(), "exited");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_dropped_child_is_killed_and_reaped_and_groups_are_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let launcher = Launcher::new(dir.path())
        .own_process_group()
        .parent_death_signal(Signal::SIGTERM);
    let mut p = sh(&launcher, "grouped", "sleep 30");
    let pid = p.id();
    let pgid =
        nix::unistd::getpgid(Some(Pid::from_raw(i32::try_from(pid).expect("pid")))).expect("pgid");
    assert_eq!(pgid.as_raw() as u32, pid, "leads its own process group");
    p.assert_running().expect("running");
    drop(p);
    assert!(gone(pid));
}

#[test]
fn a_missing_program_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = Launcher::new(dir.path())
        .spawn("ghost", &mut Command::new("/nonexistent/kvpool"))
        .expect_err("no such program");
    assert_eq!(err.category(), "spawn");
    assert!(err.to_string().contains("ghost"), "{err}");
}

#[test]
fn pipes_replace_stdin_and_stdout_when_asked() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().expect("tempdir");
    let launcher = Launcher::new(dir.path()).pipe_stdin().pipe_stdout();
    let mut p = sh(&launcher, "echo", "read x; echo got $x; echo to-log >&2");
    let mut stdin = p.take_stdin().expect("stdin");
    writeln!(stdin, "hello").expect("write");
    drop(stdin);
    let mut line = String::new();
    BufReader::new(p.take_stdout().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line, "got hello\n");
    assert!(p.wait().expect("exit").success());
    assert_eq!(p.log_text(), "to-log\n");
}
