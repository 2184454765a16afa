use proptest::prelude::*;

use super::verifier::MAX_CACHED_NODES;
use super::*;

const POOL: &[u8] = b"0123456789abcdef-pool-secret";

fn pool() -> AuthKey {
    AuthKey::from_bytes(POOL).expect("key")
}

fn verifier() -> Verifier {
    Verifier::new(&pool()).expect("pool key")
}

fn now() -> u64 {
    unix_ms()
}

#[test]
fn role_keys_are_derived_distinct_and_stable() {
    let keys: Vec<Vec<u8>> = Role::ALL.iter().map(|r| role_key(POOL, *r)).collect();
    assert_eq!(keys[0], POOL, "admin signs with the pool key");
    for (i, a) in keys.iter().enumerate() {
        for b in &keys[i + 1..] {
            assert_ne!(a, b);
        }
    }
    // Fixed vector: HMAC-SHA256(POOL, "kvpool-role-v1\nengine"); a change breaks every
    // deployed credential file.
    assert_eq!(
        credential::hex(&role_key(POOL, Role::Engine)),
        "a5385ba1723351c7c00f7b61b68b74e66382e4ca0f779081fa9ee5f2b8c88b01"
    );
    assert_ne!(
        role_key(POOL, Role::Engine),
        role_key(b"another pool key!!", Role::Engine)
    );
    assert!(pool().derive(Role::Engine).is_some());
    let engine = pool().derive(Role::Engine).expect("engine");
    assert_eq!(engine.role(), Role::Engine);
    assert!(
        engine.derive(Role::Agent).is_none(),
        "a role key derives nothing"
    );
    assert!(matches!(
        Verifier::new(&engine),
        Err(AuthError::NotPoolKey(Role::Engine))
    ));
}

#[test]
fn methods_are_named_once_and_roles_split_them_as_documented() {
    let distinct: std::collections::HashSet<&str> = METHODS.iter().copied().collect();
    assert_eq!(distinct.len(), METHODS.len(), "{METHODS:?}");
    let allowed =
        |role: Role| -> Vec<&str> { METHODS.iter().copied().filter(|m| role.allows(m)).collect() };
    assert_eq!(allowed(Role::Admin), METHODS.to_vec());
    let all_but = |skip: &[&str]| -> Vec<&str> {
        METHODS
            .iter()
            .copied()
            .filter(|m| !skip.contains(m))
            .collect()
    };
    // The conductors' own call is theirs (and the admin's).
    assert_eq!(
        allowed(Role::Agent),
        all_but(&["RemoveAll", "ShareLoad", "ReplicateHot"])
    );
    // Engines: the object calls only; no membership call, no RemoveAll (issue 38).
    let node_calls: Vec<&str> = METHODS
        .iter()
        .copied()
        .filter(|m| Role::is_node_call(m))
        .collect();
    assert_eq!(
        node_calls,
        [
            "MountSegment",
            "UnmountSegment",
            "Heartbeat",
            "CompleteTask",
            "AdoptReplicas"
        ]
    );
    let object_calls: Vec<&str> = METHODS
        .iter()
        .copied()
        .filter(|m| {
            !Role::is_node_call(m) && !["RemoveAll", "ShareLoad", "ReplicateHot"].contains(m)
        })
        .collect();
    assert_eq!(allowed(Role::Engine), object_calls);
    assert_eq!(
        allowed(Role::Conductor),
        ["Exists", "LongestPrefix", "ShareLoad", "ReplicateHot"]
    );
    assert_eq!(allowed(Role::Observer), ["Stats"]);
    assert!(!Role::Admin.allows("Nope") && !Role::Engine.allows("Nope"));
}

#[test]
fn every_role_signs_what_it_may_call_once() {
    let v = verifier();
    for role in Role::ALL {
        let key = pool().derive(role).expect("derive");
        for method in METHODS {
            let cred = key.sign(method);
            let got = v.verify(Some(&cred), method);
            if role.allows(method) {
                let ok = got.expect("allowed");
                assert_eq!(ok.role, role);
                ok.check_unbound().expect("gRPC credential");
                assert!(matches!(
                    v.verify(Some(&cred), method),
                    Err(AuthError::Replay)
                ));
            } else {
                let e = got.expect_err("forbidden");
                assert!(matches!(e, AuthError::Forbidden { .. }), "{role} {method}");
                assert_eq!(e.status().code(), tonic::Code::PermissionDenied);
                assert!(e.to_string().contains(role.name()) && e.to_string().contains(method));
            }
        }
    }
    assert!(Role::Conductor.allows("LongestPrefix") && !Role::Conductor.allows("PutStart"));
    assert!(Role::Admin.allows("RemoveAll") && !Role::Admin.allows("NoSuchMethod"));
}

#[test]
fn an_agent_credential_is_bound_to_its_node() {
    let v = verifier();
    let a = pool().derive_node("gpu-7.rack-2").expect("node key");
    assert_eq!((a.role(), a.node()), (Role::Agent, Some("gpu-7.rack-2")));
    // Fixed vector: HMAC-SHA256(POOL, "kvpool-node-v1\nagent\ngpu-7.rack-2"); a change breaks
    // every deployed node credential.
    assert_eq!(
        credential::hex(&node_key(POOL, "gpu-7.rack-2")),
        credential::hex(&{
            use hmac::Mac;
            let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(POOL).expect("key");
            m.update(b"kvpool-node-v1\nagent\ngpu-7.rack-2");
            m.finalize().into_bytes().to_vec()
        })
    );
    assert_ne!(node_key(POOL, "a"), node_key(POOL, "b"));
    assert_ne!(node_key(POOL, "a"), role_key(POOL, Role::Agent));
    let cred = a.sign("MountSegment");
    let ok = v.verify(Some(&cred), "MountSegment").expect("valid");
    assert_eq!(ok.node.as_deref(), Some("gpu-7.rack-2"));
    ok.may_act_for("gpu-7.rack-2").expect("own node");
    let e = ok.may_act_for("gpu-8").expect_err("another node");
    assert!(e.contains("gpu-7.rack-2") && e.contains("gpu-8"), "{e}");
    // The node named in the credential cannot be changed: the MAC covers it, and the key is
    // the node's.
    let other = credential::hex(b"gpu-8");
    let own = credential::hex(b"gpu-7.rack-2");
    let moved = a.sign("Heartbeat").replace(&own, &other);
    assert!(matches!(
        v.verify(Some(&moved), "Heartbeat"),
        Err(AuthError::BadMac)
    ));
    // Signing another node's principal with the shared agent key fails too.
    let shared = pool().derive(Role::Agent).expect("agent");
    let forged = credential::sign(
        &keyed(&role_key(POOL, Role::Agent)),
        &credential::principal(Role::Agent, Some("gpu-8")),
        "Heartbeat",
        None,
        now(),
        9,
    );
    assert!(matches!(
        v.verify(Some(&forged), "Heartbeat"),
        Err(AuthError::BadMac)
    ));
    // Node-less agent credentials act for a node only where the verifier allows shared ones.
    let plain = v
        .verify(Some(&shared.sign("Heartbeat")), "Heartbeat")
        .expect("valid");
    assert!(plain.may_act_for("gpu-8").is_err());
    let lenient = verifier().allow_shared_agents(true);
    let plain = lenient
        .verify(Some(&shared.sign("Heartbeat")), "Heartbeat")
        .expect("valid");
    plain.may_act_for("gpu-8").expect("shared allowed");
    let bound = lenient
        .verify(Some(&a.sign("Heartbeat")), "Heartbeat")
        .expect("valid");
    assert!(
        bound.may_act_for("gpu-8").is_err(),
        "a bound one stays bound"
    );
    let admin = v
        .verify(Some(&pool().sign("Heartbeat")), "Heartbeat")
        .expect("admin");
    admin
        .may_act_for("anything")
        .expect("admin acts for any node");
    let engine = pool().derive(Role::Engine).expect("engine");
    let e = v
        .verify(Some(&engine.sign("Heartbeat")), "Heartbeat")
        .expect_err("engines make no node calls");
    assert!(matches!(e, AuthError::Forbidden { .. }));
    // Only agents name a node; node names are bounded.
    let bad = format!("v2.engine@{own}.{}.{:032x}..{}", now(), 1, "0".repeat(64));
    assert!(matches!(parse(&bad), Err(AuthError::Malformed(_))));
    for node in ["", "zz", &credential::hex(&[b'a'; MAX_NODE_LEN + 1])] {
        let bad = format!("v2.agent@{node}.{}.{:032x}..{}", now(), 1, "0".repeat(64));
        assert!(
            matches!(parse(&bad), Err(AuthError::Malformed(_))),
            "{node}"
        );
    }
    assert!(pool().derive_node("").is_none());
    assert!(pool().derive_node("a\nb").is_none());
    assert!(
        shared.derive_node("gpu-7").is_none(),
        "only the pool key issues node keys"
    );
}

#[test]
fn a_credential_is_bound_to_its_method_and_role_key() {
    let v = verifier();
    let admin = pool();
    let cred = admin.sign("Exists");
    assert!(matches!(
        v.verify(Some(&cred), "Remove"),
        Err(AuthError::BadMac)
    ));
    // Claiming another role with one's own key fails the MAC.
    let conductor = admin.derive(Role::Conductor).expect("derive");
    let forged = conductor
        .sign("PutStart")
        .replacen("conductor", "engine", 1);
    assert!(matches!(
        v.verify(Some(&forged), "PutStart"),
        Err(AuthError::BadMac)
    ));
    // A role key of another pool.
    let other = AuthKey::from_bytes(b"another pool key 0123")
        .and_then(|k| k.derive(Role::Engine))
        .expect("key");
    assert!(matches!(
        v.verify(Some(&other.sign("Get")), "Get"),
        Err(AuthError::BadMac)
    ));
}

#[test]
fn fast_lane_credentials_are_bound_to_the_body() {
    let v = verifier();
    let k = pool().derive(Role::Engine).expect("derive");
    let cred = k.sign_body("Get", b"body");
    let ok = v.verify(Some(&cred), "Get").expect("valid");
    ok.check_body(b"body").expect("same body");
    assert!(matches!(
        ok.check_body(b"bodx"),
        Err(AuthError::BodyMismatch)
    ));
    assert!(matches!(ok.check_unbound(), Err(AuthError::Binding(_))));
    let unbound = v.verify(Some(&k.sign("Get")), "Get").expect("valid");
    assert!(matches!(
        unbound.check_body(b"body"),
        Err(AuthError::Binding(_))
    ));
}

#[test]
fn stale_missing_and_malformed_credentials_are_refused() {
    let v = verifier();
    let k = pool();
    let far = now() + 10 * 60_000;
    assert!(matches!(
        v.verify_at(Some(&k.sign("Get")), "Get", far),
        Err(AuthError::Skew(_))
    ));
    assert!(matches!(v.verify(None, "Get"), Err(AuthError::Missing)));
    let good = k.sign_at("Get", None, 5, 7);
    let fields: Vec<&str> = good.split('.').collect();
    for bad in [
        String::new(),
        "v2".into(),
        good.replacen("v2", "v1", 1),
        format!("v1.1.{}.{}", fields[3], fields[5]),
        good.replacen(".admin.", ".root.", 1),
        good.replacen(".5.", ".x.", 1),
        good.replacen(".5.", ".99999999999999999999999.", 1),
        good.replacen(fields[3], "0123", 1),
        good.replacen(fields[3], &fields[3].to_uppercase().replace('0', "G"), 1),
        format!("{good}.extra"),
        good.replacen(fields[5], "zz", 1),
        good.replacen("..", ".00.", 1),
    ] {
        assert!(
            matches!(
                v.verify_at(Some(&bad), "Get", 5),
                Err(AuthError::Malformed(_))
            ),
            "{bad}"
        );
    }
    v.verify_at(Some(&good), "Get", 5)
        .expect("the untouched one passes");
    assert!(AuthKey::from_bytes(b"short\n").is_none());
}

#[test]
fn key_files_are_raw_pool_keys_or_role_documents() {
    let dir = tempfile::tempdir().expect("tmp");
    let p = dir.path().join("key");
    std::fs::write(&p, "0123456789abcdef0123\n").expect("write");
    let k = AuthKey::from_file(&p).expect("key");
    assert_eq!(k.role(), Role::Admin);
    let v =
        Verifier::new(&AuthKey::from_bytes(b"0123456789abcdef0123").expect("key")).expect("pool");
    v.verify(Some(&k.sign("Stats")), "Stats").expect("same key");

    let doc = k.role_document(Role::Conductor, Some(b"transfer-key-0123456"));
    let doc = doc.expect("pool key");
    assert_eq!(doc.transfer, None, "the conductor moves no KV bytes");
    std::fs::write(&p, doc.to_json()).expect("write");
    let c = AuthKey::from_file(&p).expect("conductor file");
    assert_eq!(c.role(), Role::Conductor);
    v.verify(Some(&c.sign("LongestPrefix")), "LongestPrefix")
        .expect("lookup");
    assert!(matches!(
        v.verify(Some(&c.sign("PutStart")), "PutStart"),
        Err(AuthError::Forbidden { .. })
    ));
    let engine = k
        .role_document(Role::Engine, Some(b"transfer-key-0123456"))
        .expect("doc");
    assert_eq!(
        RoleDocument::parse(engine.to_json().as_bytes()).expect("parse"),
        engine
    );
    // A node-bound agent's file: its node and that node's key.
    let node = k
        .node_document("gpu-3", Some(b"transfer-key-0123456"))
        .expect("node doc");
    assert_eq!(
        RoleDocument::parse(node.to_json().as_bytes()).expect("parse"),
        node
    );
    std::fs::write(&p, node.to_json()).expect("write");
    let a = AuthKey::from_file(&p).expect("agent file");
    assert_eq!((a.role(), a.node()), (Role::Agent, Some("gpu-3")));
    let ok = v
        .verify(Some(&a.sign("Heartbeat")), "Heartbeat")
        .expect("node credential");
    assert_eq!(ok.node.as_deref(), Some("gpu-3"));

    let key_hex = "00".repeat(16);
    let with_node = |role: &str, node: &str| {
        format!(r#"{{"role":"{role}","master":"{key_hex}","node":{node}}}"#)
    };
    for (text, needle) in [
        (with_node("engine", "\"gpu-3\""), "names no node"),
        (with_node("agent", "\"\""), "not a node name"),
        (with_node("agent", "7"), "not a string"),
    ] {
        std::fs::write(&p, &text).expect("write");
        let e = AuthKey::from_file(&p).expect_err(&text);
        assert!(e.to_string().contains(needle), "{text}: {e}");
    }

    for (text, needle) in [
        ("{", "not a JSON document"),
        ("{}", "role"),
        (r#"{"role":"root","master":"00"}"#, "unknown role"),
        (r#"{"role":"admin","master":"00"}"#, "raw pool key"),
        (r#"{"role":"engine"}"#, "master"),
        (r#"{"role":"engine","master":"xyz"}"#, "hex"),
        (r#"{"role":"engine","master":"00"}"#, "shorter"),
        (r#"{"role":"engine","master":7}"#, "not a string"),
    ] {
        std::fs::write(&p, text).expect("write");
        let e = AuthKey::from_file(&p).expect_err(text);
        assert!(matches!(e, AuthError::Document { .. }), "{text}: {e}");
        assert!(e.to_string().contains(needle), "{text}: {e}");
    }
    std::fs::write(&p, "short").expect("write");
    assert!(matches!(
        AuthKey::from_file(&p),
        Err(AuthError::ShortKey(_))
    ));
    assert!(matches!(
        AuthKey::from_file(&dir.path().join("none")),
        Err(AuthError::ReadKey { .. })
    ));
}

fn arb_role() -> impl Strategy<Value = Role> {
    prop::sample::select(Role::ALL.to_vec())
}

fn arb_method() -> impl Strategy<Value = &'static str> {
    prop::sample::select(METHODS.to_vec())
}

proptest! {
    #[test]
    fn arbitrary_header_text_never_panics(header in ".{0,300}", method in arb_method()) {
        let v = verifier();
        let got = v.verify_at(Some(&header), method, 1_000_000);
        prop_assert!(got.is_err());
    }

    #[test]
    fn mutated_credentials_never_pass_and_never_panic(
        role in arb_role(),
        method in arb_method(),
        ts in 0u64..1 << 50,
        nonce in any::<u128>(),
        body in prop::option::of(prop::collection::vec(any::<u8>(), 0..64)),
        at in 0usize..200,
        byte in any::<u8>(),
    ) {
        let v = verifier();
        let key = pool().derive(role).expect("derive");
        let cred = key.sign_at(method, body.as_deref(), ts, nonce);
        let mut bytes = cred.clone().into_bytes();
        let i = at % bytes.len();
        prop_assume!(bytes[i] != byte);
        bytes[i] = byte;
        let mutated = String::from_utf8_lossy(&bytes).into_owned();
        let r = v.verify_at(Some(&mutated), method, ts);
        prop_assert!(r.is_err(), "{mutated} passed");
        // The original still checks out exactly for its role's permitted methods.
        let r = v.verify_at(Some(&cred), method, ts);
        prop_assert_eq!(r.is_ok(), role.allows(method));
    }
}

#[test]
fn node_keys_are_derived_once_and_only_for_credentials_that_verified() {
    let v = verifier();
    // A forged credential for a node (a wrong key): refused, and its node is not kept.
    let forged = AuthKey::from_node_key("ghost", &[7u8; 32]).expect("key");
    assert!(matches!(
        v.verify(Some(&forged.sign("Heartbeat")), "Heartbeat"),
        Err(AuthError::BadMac)
    ));
    assert!(!v.nodes.lock().contains_key("ghost"));
    // A real node's credential verifies the first time (derived) and again (cached), and a
    // forged one for that same node still fails against the cached key.
    let a = pool().derive_node("gpu-1").expect("node key");
    for _ in 0..2 {
        v.verify(Some(&a.sign("Heartbeat")), "Heartbeat")
            .expect("valid");
    }
    assert!(v.nodes.lock().contains_key("gpu-1"));
    let forged_a = AuthKey::from_node_key("gpu-1", &[9u8; 32]).expect("key");
    assert!(matches!(
        v.verify(Some(&forged_a.sign("Heartbeat")), "Heartbeat"),
        Err(AuthError::BadMac)
    ));
    // Past the bound the cache starts over; every node still verifies.
    for i in 0..MAX_CACHED_NODES + 10 {
        let k = pool().derive_node(&format!("n{i}")).expect("node key");
        v.verify(Some(&k.sign("Heartbeat")), "Heartbeat")
            .expect("valid");
    }
    assert!(v.nodes.lock().len() <= MAX_CACHED_NODES);
}
