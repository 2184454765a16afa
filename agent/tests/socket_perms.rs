//! The engine API's socket and staging files are handed to the engines' group, so that engines
//! running as another user (the operator runs them as the images' non-root user with that
//! fsGroup) can connect and map their staging areas.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use kvpool_agent::api::server;
use kvpool_agent::api::shm::Staging;

/// Our effective user and group, read off a file we create (no unsafe libc calls needed).
fn own_ids() -> (u32, u32) {
    let f = tempfile::NamedTempFile::new().expect("temp file");
    let meta = f.as_file().metadata().expect("metadata");
    (meta.uid(), meta.gid())
}

fn own_gid() -> u32 {
    own_ids().1
}

#[tokio::test]
async fn socket_is_group_writable_and_owned_by_the_client_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = dir.path().join("run");
    // Our own group is the one group any user may hand a file to, root or not.
    let (_listener, path) = server::bind_for_group(&run, Some(own_gid())).expect("bind");
    let meta = std::fs::metadata(&path).expect("socket metadata");
    assert_eq!(meta.gid(), own_gid());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);

    // Without a group the socket keeps the process default, and rebinding replaces the file.
    drop(_listener);
    let (_listener, path) = server::bind(&run).expect("rebind");
    assert!(std::fs::metadata(&path).is_ok());
}

#[test]
fn staging_files_are_handed_to_the_client_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let staging =
        Staging::create_for_group(dir.path(), "perm", 8192, Some(own_gid())).expect("create");
    let meta = std::fs::metadata(staging.path()).expect("staging metadata");
    assert_eq!(meta.gid(), own_gid());
    assert_eq!(meta.len(), 8192);
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o660,
        "group may read and write"
    );
}

#[tokio::test]
async fn handing_to_a_group_we_may_not_use_fails_with_the_path_named() {
    if own_ids().0 != 0 {
        // As non-root, chown to a foreign group fails: that failure must name the socket.
        let dir = tempfile::tempdir().expect("tempdir");
        let err = server::bind_for_group(&dir.path().join("run"), Some(own_gid() + 1))
            .expect_err("foreign group");
        assert!(err.to_string().contains("agent.sock"), "{err}");
    } else {
        // Root may hand files to any group: the engines' group id is applied as given.
        let dir = tempfile::tempdir().expect("tempdir");
        let gid = kvpool_crd::POOL_CLIENT_GROUP;
        let (_l, path) = server::bind_for_group(&dir.path().join("run"), Some(gid)).expect("bind");
        assert_eq!(std::fs::metadata(&path).expect("meta").gid(), gid);
    }
}
