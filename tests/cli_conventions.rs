//! The flag naming rules of docs/cli.md, held for every subcommand of the `kvpool` binary: the
//! whole clap command tree is walked, and each renamed flag's old spelling must still parse to
//! exactly what its new spelling parses to. In-process; no I/O.

use clap::CommandFactory;
use kvpool::cli::{Cli, Command};
use kvpool_bench::BenchCommand;

/// Every visible long flag of every (sub)command, as `("kvpool master", "admin-listen")`.
fn visible_flags() -> Vec<(String, String)> {
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, String)>) {
        for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            if let Some(long) = arg.get_long() {
                out.push((path.to_owned(), long.to_owned()));
            }
        }
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }
    let mut out = Vec::new();
    walk(&Cli::command(), "kvpool", &mut out);
    out
}

#[test]
fn every_visible_flag_is_kebab_case() {
    let flags = visible_flags();
    assert!(flags.len() > 200, "walked only {} flags", flags.len());
    let bad: Vec<_> = flags
        .iter()
        .filter(|(_, f)| {
            f.is_empty()
                || f.starts_with('-')
                || f.ends_with('-')
                || f.contains("--")
                || !f
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
        .collect();
    assert!(bad.is_empty(), "flags not in kebab-case: {bad:?}");
}

#[test]
fn units_are_in_values_not_in_names() {
    // A plain number of seconds is allowed only for cost-model coefficients (docs/cli.md).
    let coefficient = |f: &str| f.starts_with("prefill-") || f.starts_with("decode-");
    let bad: Vec<_> = visible_flags()
        .into_iter()
        .filter(|(_, f)| {
            f.ends_with("-gbps")
                || f == "admin-addr"
                || f == "bytes-per-token"
                || (f.ends_with("-s") && !coefficient(f))
        })
        .collect();
    assert!(bad.is_empty(), "flags against the naming rules: {bad:?}");
}

fn parse(argv: &[&str]) -> Result<Cli, clap::Error> {
    use clap::Parser;
    Cli::try_parse_from(std::iter::once("kvpool").chain(argv.iter().copied()))
}

fn parsed(argv: &[&str]) -> String {
    match parse(argv) {
        Ok(cli) => format!("{:?}", cli.command),
        Err(e) => panic!("{argv:?} does not parse: {e}"),
    }
}

#[test]
fn old_spellings_parse_like_the_new_ones() {
    // Command lines, split at spaces: the old spellings, and the same with the new ones.
    let pairs = [
        (
            "master --auth-key-file k --admin-addr 127.0.0.1:9",
            "master --auth-key-file k --admin-listen 127.0.0.1:9",
        ),
        (
            "operator run --root-key-file k --admin-addr 127.0.0.1:9",
            "operator run --root-key-file k --admin-listen 127.0.0.1:9",
        ),
        (
            "conductor --ttft-slo-s 2.5 --tpot-slo-s 0.05 --bytes-per-token 10 \
             --kv-bandwidth-gbps 12.5 --pool-bandwidth-gbps 25",
            "conductor --ttft-slo 2500ms --tpot-slo 50ms --kv-bytes-per-token 10 \
             --kv-bandwidth 100Gbit/s --pool-bandwidth 25GB/s",
        ),
        (
            "bench transfer --block_size 4MiB --batch_size 4 --buffer_size 64MiB --no_baselines \
             --baseline_duration 2 --vs_mooncake --duration 3 --timeout 7",
            "bench transfer --block-size 4MiB --batch-size 4 --buffer-size 64MiB --no-baselines \
             --baseline-duration 2s --vs-mooncake --duration 3s --timeout 7s",
        ),
        (
            "bench store --vs_mooncake --mooncake_venv /v",
            "bench store --vs-mooncake --mooncake-venv /v",
        ),
        (
            "bench conductor --vs_sglang_router --router_venv /r",
            "bench conductor --vs-sglang-router --router-venv /r",
        ),
    ];
    for (old, new) in pairs {
        let old: Vec<&str> = old.split(' ').collect();
        let new: Vec<&str> = new.split(' ').collect();
        assert_eq!(parsed(&old), parsed(&new), "{old:?} vs {new:?}");
    }
    // A new value with a space in it, so not in the table above.
    let old = ["up", "--grace-s", "1.5", "--ready-timeout-s", "90"];
    let new = ["up", "--grace", "1500ms", "--ready-timeout", "1m 30s"];
    assert_eq!(parsed(&old), parsed(&new), "{old:?} vs {new:?}");
    // The old subcommand takes the same flags as the new one.
    let Ok(Cli {
        command: Command::MasterBench(old),
        ..
    }) = parse(&["master-bench", "--objects", "7", "--duration", "1s"])
    else {
        panic!("master-bench does not parse")
    };
    let Ok(Cli {
        command: Command::Bench(bench),
        ..
    }) = parse(&["bench", "master", "--objects", "7", "--duration", "1s"])
    else {
        panic!("bench master does not parse")
    };
    let BenchCommand::Master(new) = bench.command else {
        panic!("bench master is {:?}", bench.command)
    };
    assert_eq!(format!("{old:?}"), format!("{new:?}"));
}

#[test]
fn bad_durations_and_rates_are_refused_naming_the_value() {
    for (argv, needle) in [
        (&["conductor", "--ttft-slo", "soon"][..], "soon"),
        (
            &["conductor", "--pool-bandwidth", "25 furlongs/s"][..],
            "furlongs",
        ),
        (&["conductor", "--kv-bandwidth", "0"][..], "above zero"),
        (&["up", "--grace=-1s"][..], "-1s"),
    ] {
        let e = parse(argv).unwrap_err().to_string();
        assert!(e.contains(needle), "{argv:?}: {e}");
    }
}

#[test]
fn renamed_environment_variables_carry_over_unless_the_new_one_is_set() {
    use std::ffi::OsString;
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        }
    };
    let carried = kvpool::cli::renamed_env_vars(env(&[("KVPOOL_ADMIN_ADDR", "127.0.0.1:1")]));
    assert_eq!(
        carried,
        vec![(
            "KVPOOL_ADMIN_ADDR",
            "KVPOOL_OPERATOR_ADMIN_LISTEN",
            OsString::from("127.0.0.1:1")
        )]
    );
    let both = kvpool::cli::renamed_env_vars(env(&[
        ("KVPOOL_MASTER_ADMIN_ADDR", "127.0.0.1:1"),
        ("KVPOOL_MASTER_ADMIN_LISTEN", "127.0.0.1:2"),
    ]));
    assert!(both.is_empty(), "the new name wins: {both:?}");
    // Each new name is the env of the renamed flag.
    let flags_env: Vec<String> = kvpool::cli::RENAMED_ENV_VARS
        .iter()
        .map(|(_, new)| new.to_string())
        .collect();
    let mut found = Vec::new();
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            if let Some(e) = a.get_env() {
                out.push(e.to_string_lossy().into_owned());
            }
        }
        for s in cmd.get_subcommands() {
            walk(s, out);
        }
    }
    walk(&Cli::command(), &mut found);
    for name in flags_env {
        assert!(
            found.contains(&name),
            "{name} is no flag's environment variable"
        );
    }
}

/// Issue 34: `kvpool completions <shell>` prints a completion script that the shell accepts
/// (bash parses it with `-n`) and that knows the subcommands and their flags.
#[test]
fn completions_are_a_valid_bash_script_naming_subcommands_and_flags() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["completions", "bash"])
        .output()
        .expect("run kvpool completions");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = String::from_utf8(out.stdout).expect("utf8");
    for word in [
        "conductor",
        "agent",
        "operator",
        "--api-key-file",
        "--root-key-secret",
    ] {
        assert!(script.contains(word), "the script lacks {word}");
    }
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("kvpool.bash");
    std::fs::write(&file, &script).expect("write");
    let check = std::process::Command::new("bash")
        .arg("-n")
        .arg(&file)
        .output()
        .expect("bash");
    assert!(
        check.status.success(),
        "bash refuses the script: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    for shell in ["zsh", "fish"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"))
            .args(["completions", shell])
            .output()
            .expect("run");
        assert!(out.status.success() && out.stdout.len() > 1000, "{shell}");
    }
}

/// The `kvpool up` subcommand's clap definition.
fn up_command() -> clap::Command {
    Cli::command()
        .find_subcommand("up")
        .expect("kvpool up")
        .clone()
}

/// Issue 34: every flag of `kvpool up` can be set in the environment, under one scheme
/// (`KVPOOL_UP_` and the flag in upper snake case), and `--help` shows the variable.
#[test]
fn every_up_flag_has_an_environment_variable_of_the_scheme() {
    let up = up_command();
    let mut seen = 0;
    for arg in up.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if ["help", "version"].contains(&long) {
            continue;
        }
        seen += 1;
        let expected = format!("KVPOOL_UP_{}", long.to_uppercase().replace('-', "_"));
        let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
        assert_eq!(
            env.as_deref(),
            Some(expected.as_str()),
            "kvpool up --{long}"
        );
        assert!(
            !arg.is_hide_env_set(),
            "--help hides the variable of --{long}"
        );
    }
    assert!(seen >= 30, "only {seen} flags of kvpool up");
    let help = up_command().render_long_help().to_string();
    for var in [
        "KVPOOL_UP_AGENT_DRAM",
        "KVPOOL_UP_ENGINE_PYTHON",
        "KVPOOL_UP_READY_TIMEOUT",
    ] {
        assert!(
            help.contains(&format!("[env: {var}=")),
            "--help lacks {var}"
        );
    }
}

/// `kvpool up` run with these variables and flags, up to its first error (each case below
/// fails before any child starts); its stderr.
fn up_fails_with(env: &[(&str, &str)], args: &[&str]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"));
    cmd.arg("up").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run kvpool up");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "kvpool up {args:?} with {env:?} succeeded: {err}"
    );
    err
}

/// An `up` variable takes effect, and a flag given on the command line wins over it.
#[test]
fn up_environment_variables_take_effect_and_flags_win() {
    // Parsed by its flag's parser: a bad value is refused naming the variable's value.
    let err = up_fails_with(&[("KVPOOL_UP_AGENTS", "many")], &[]);
    assert!(err.contains("many") && err.contains("--agents"), "{err}");
    // The flag wins: the variable's bad value is never parsed, the flag's is checked.
    let err = up_fails_with(&[("KVPOOL_UP_AGENTS", "many")], &["--agents", "0"]);
    assert!(!err.contains("many") && err.contains("agents"), "{err}");
    // A value from the environment is used: the trace it names is read (and is missing),
    // and it satisfies `--limit`'s need of `--replay`.
    let trace = "/nonexistent/kvpool-up-env-trace.jsonl";
    let err = up_fails_with(
        &[("KVPOOL_UP_REPLAY", trace), ("KVPOOL_UP_LIMIT", "3")],
        &[],
    );
    assert!(err.contains(trace), "{err}");
    let err = up_fails_with(&[("KVPOOL_UP_PREFILL", "0")], &[]);
    assert!(
        err.contains("prefill") && err.contains("at least 1"),
        "{err}"
    );
    // Switches take the usual words for yes and no.
    for yes in ["1", "yes", "true", "on"] {
        let err = up_fails_with(&[("KVPOOL_UP_JSON", yes), ("KVPOOL_UP_PREFILL", "0")], &[]);
        assert!(err.contains("prefill"), "KVPOOL_UP_JSON={yes}: {err}");
    }
    let err = up_fails_with(&[("KVPOOL_UP_TLS", "maybe")], &[]);
    assert!(err.contains("maybe") && err.contains("--tls"), "{err}");
    // The old name of a renamed variable still reaches its flag.
    let err = up_fails_with(
        &[("KVPOOL_ENGINE_ARGS", "--x"), ("KVPOOL_UP_PREFILL", "0")],
        &[],
    );
    assert!(
        err.contains("KVPOOL_ENGINE_ARGS") && err.contains("KVPOOL_UP_ENGINE_ARGS"),
        "{err}"
    );
}
