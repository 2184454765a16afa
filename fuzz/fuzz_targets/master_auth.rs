//! The master's request credential (`x-kvpool-auth`, checked on every gRPC and fast-lane
//! call): the first 8 input bytes are the master's clock (ms), the rest the header value.
//! Credentials are checked for the `Get` call (the seeds are signed for it). Garbage is refused
//! with an error; a credential that is accepted is refused as a replay the second time.
#![no_main]

use std::sync::OnceLock;

use kvpool_fuzz::{KEY, take_u64};
use kvpool_proto::auth::{AuthError, AuthKey, Verifier};
use libfuzzer_sys::fuzz_target;

fn verifier() -> &'static Verifier {
    static V: OnceLock<Verifier> = OnceLock::new();
    V.get_or_init(|| {
        Verifier::new(&AuthKey::from_bytes(KEY).expect("fuzz key")).expect("admin key verifier")
    })
}

fuzz_target!(|data: &[u8]| {
    let (now_ms, header) = take_u64(data);
    // Header values reach the verifier as text (tonic's `to_str`, the fast lane's UTF-8 check).
    let Ok(header) = std::str::from_utf8(header) else {
        return;
    };
    let v = verifier();
    if v.verify_at(Some(header), "Get", now_ms).is_ok() {
        assert!(
            matches!(
                v.verify_at(Some(header), "Get", now_ms),
                Err(AuthError::Replay)
            ),
            "a credential was accepted twice"
        );
    }
});
