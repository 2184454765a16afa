//! Prerequisites a test machine may lack (a tool, root, network namespaces, the shared traces):
//! on a developer's machine such a test prints `SKIP: <what>` and returns; under CI (the `CI`
//! variable set, as CI sets it for `.ci/run`) it fails instead, because `scripts/deps.sh` and
//! `scripts/tools.sh` install every prerequisite there and CI runs as root, so a skip in CI
//! would hide a broken install. No I/O but the message.

/// Whether this run is CI's: `CI` set to anything but empty, `0` or `false`.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}

/// Reports that the calling test cannot run for want of `what`: a SKIP line, or under CI a
/// failure naming it. The caller returns right after.
pub fn skip(what: &str) {
    assert!(
        !in_ci(),
        "{what}: CI installs every prerequisite of the tests and runs as root, so this test fails instead of skipping"
    );
    println!("SKIP: {what}");
}
