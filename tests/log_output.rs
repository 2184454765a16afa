//! What the `kvpool` binary's logs look like where they end up: a log file gets plain text (no
//! ESC byte, even with a colour-capable `TERM`), `--log-format json` gives one JSON object per
//! line, and a terminal gets colour unless `NO_COLOR` or `TERM=dumb` says no. The child is
//! `kvpool operator run` without a cluster: it logs its start at INFO, then fails to find a
//! Kubernetes configuration and exits on its own. I/O boundary: child processes (the binary, and
//! util-linux `script` to give it a pseudo-terminal) and files under the test's temp directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const ESC: u8 = 0x1b;
/// The line `kvpool operator run` logs before it looks for a cluster.
const STARTING: &str = "kvpool-operator starting";

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("log_output")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `kvpool [log flags] operator run` with no way to reach a cluster, in `dir` as its HOME,
/// with `TERM` and `NO_COLOR` as given and nothing else from the environment that could
/// choose a colour or a cluster.
fn operator_without_cluster(
    program: &str,
    args: &[&str],
    dir: &Path,
    term: &str,
    no_color: Option<&str>,
) -> Command {
    // A root key, so that the operator gets as far as looking for a cluster.
    let root_key = dir.join("root-key");
    std::fs::write(&root_key, "0123456789abcdef0123456789abcdef\n").expect("root key");
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("KVPOOL_OPERATOR_ROOT_KEY_FILE", &root_key)
        .env("HOME", dir)
        .env("KUBECONFIG", dir.join("no-such-kubeconfig"))
        .env("TERM", term)
        .env("RUST_LOG", "info")
        .current_dir(dir)
        .stdin(Stdio::null());
    if let Some(value) = no_color {
        cmd.env("NO_COLOR", value);
    }
    cmd
}

const KVPOOL_ARGS: &[&str] = &["operator", "run", "--admin-listen", "127.0.0.1:0"];

/// Runs the child with stderr (its log) in a file and returns the file's bytes.
fn log_to_file(test: &str, log_format: &str) -> Vec<u8> {
    let dir = scratch(test);
    let log = dir.join("kvpool.log");
    let file = std::fs::File::create(&log).expect("log file");
    let mut args = vec!["--log-format", log_format];
    args.extend(KVPOOL_ARGS);
    let status = operator_without_cluster(
        env!("CARGO_BIN_EXE_kvpool"),
        &args,
        &dir,
        "xterm-256color",
        None,
    )
    .stdout(Stdio::null())
    .stderr(file)
    .status()
    .expect("start kvpool");
    let bytes = std::fs::read(&log).expect("read log");
    assert!(
        !status.success(),
        "kvpool operator run found a cluster; the test needs none"
    );
    assert!(
        String::from_utf8_lossy(&bytes).contains(STARTING),
        "no start line in the log:\n{}",
        String::from_utf8_lossy(&bytes)
    );
    bytes
}

#[test]
fn text_logs_in_a_file_carry_no_escape_codes() {
    let bytes = log_to_file("text", "text");
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        !bytes.contains(&ESC),
        "ESC in a log file written with TERM=xterm-256color:\n{text:?}"
    );
    assert!(text.contains(" INFO "), "{text}");
}

#[test]
fn json_logs_are_one_object_per_line_without_escape_codes() {
    let bytes = log_to_file("json", "json");
    assert!(!bytes.contains(&ESC));
    let text = String::from_utf8_lossy(&bytes);
    let mut levels = Vec::new();
    // After the records comes the error `main` returns (`Error: ...` and its causes), which
    // the runtime prints and which is not a log record.
    for line in text
        .lines()
        .take_while(|l| !l.starts_with("Error: "))
        .filter(|l| !l.is_empty())
    {
        let record: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        levels.push(record["level"].as_str().unwrap_or_default().to_owned());
    }
    assert!(levels.iter().any(|l| l == "INFO"), "{text}");
}

/// The child's output as seen on a pseudo-terminal (util-linux `script`).
fn on_a_terminal(test: &str, term: &str, no_color: Option<&str>) -> Vec<u8> {
    let dir = scratch(test);
    let mut line = vec![
        env!("CARGO_BIN_EXE_kvpool").to_owned(),
        "--log-format=text".into(),
    ];
    line.extend(KVPOOL_ARGS.iter().map(|a| (*a).to_owned()));
    let out = operator_without_cluster(
        "script",
        &["--quiet", "--command", &line.join(" "), "/dev/null"],
        &dir,
        term,
        no_color,
    )
    .output()
    .expect("start script (util-linux)");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(STARTING),
        "no start line on the terminal:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn a_terminal_gets_colour_unless_no_color_or_a_dumb_term() {
    assert!(
        on_a_terminal("tty", "xterm-256color", None).contains(&ESC),
        "no colour on a terminal"
    );
    assert!(
        !on_a_terminal("tty_no_color", "xterm-256color", Some("1")).contains(&ESC),
        "colour with NO_COLOR=1"
    );
    assert!(
        !on_a_terminal("tty_dumb", "dumb", None).contains(&ESC),
        "colour with TERM=dumb"
    );
}

/// Each server states its effective configuration once at start-up as structured fields (one
/// JSON object with `--log-format json`), not as a `Debug` dump of its config struct.
#[test]
fn servers_log_a_structured_configuration_summary_at_start() {
    use std::io::{BufRead as _, BufReader};
    let dir = scratch("summary");
    for (args, message, fields) in [
        (
            &[
                "conductor",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--ttft-slo",
                "2s",
            ][..],
            "starting conductor",
            &[
                ("ttft_slo_s", "2.0"),
                ("prefill", "0"),
                ("policy", "\"conductor\""),
                ("protocol", "\"vllm\""),
            ][..],
        ),
        (
            &[
                "engine",
                "--synthetic",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--model",
                "m-1",
            ][..],
            "starting synthetic engine",
            &[("model", "\"m-1\""), ("agent", "false")][..],
        ),
    ] {
        let mut child = operator_without_cluster(
            env!("CARGO_BIN_EXE_kvpool"),
            &[&["--log-format", "json"][..], args].concat(),
            &dir,
            "dumb",
            None,
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvpool");
        let stderr = child.stderr.take().expect("stderr");
        let mut seen = Vec::new();
        let record = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .inspect(|l| seen.push(l.clone()))
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
            .find(|r| r["fields"]["message"] == message);
        let _ = child.kill();
        let _ = child.wait();
        let record = record.unwrap_or_else(|| panic!("no {message:?} line in {seen:#?}"));
        for (field, want) in fields {
            assert_eq!(
                record["fields"][field].to_string(),
                *want,
                "{field} of {record}"
            );
        }
        assert!(
            record["fields"].get("config").is_none(),
            "a Debug dump instead of fields: {record}"
        );
    }
}
