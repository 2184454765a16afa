//! The check of every call's credential (see [`kvpool_proto::auth`]) on both lanes: the
//! role's MAC over the method, the role's permission for it (PERMISSION_DENIED otherwise), the
//! replay cache, and, on a leader, that the credential was made after this master became the
//! leader (a credential captured on its way to the previous leader cannot be replayed here;
//! docs/reliability.md, "Credentials"). gRPC learns the method from the request path, which
//! [`WithMethod`] copies into the request's extensions before the interceptor runs. I/O
//! boundary: none (the wall clock).

use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tonic::service::Interceptor;

use super::core::Core;
use super::limits::ConnAuth;
use kvpool_proto::auth::{AUTH_HEADER, Verified, Verifier};

/// The gRPC method name of a call (`PutStart`), from its path.
#[derive(Clone, Debug)]
pub(super) struct CallMethod(String);

/// A gRPC service with each request's method name copied into its extensions, for the
/// interceptor inside it.
#[derive(Clone, Debug)]
pub struct WithMethod<S>(pub S);

impl<S, B> Service<http::Request<B>> for WithMethod<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let method = req.uri().path().rsplit('/').next().unwrap_or_default();
        let method = CallMethod(method.chars().take(64).collect());
        req.extensions_mut().insert(method);
        self.0.call(req)
    }
}

impl<S: NamedService> NamedService for WithMethod<S> {
    const NAME: &'static str = S::NAME;
}

/// Check a call of `method` carrying the credential `header`, on a master whose state is
/// `core`.
pub(super) fn check(
    verifier: &Verifier,
    core: &Core,
    header: Option<&str>,
    method: &str,
) -> Result<Verified, Status> {
    let verified = verifier.verify(header, method).map_err(|e| {
        tracing::debug!(method, error = %e, "call refused by authentication");
        e.status()
    })?;
    if verified.ts_ms < core.role.leader_since_ms() {
        // UNAVAILABLE: the client retries with a fresh credential.
        return Err(Status::unavailable(
            "credential made before this master became the leader; retry with a fresh one",
        ));
    }
    Ok(verified)
}

/// The gRPC API's check of every call's credential, which also marks the call's connection
/// as authenticated (lifting its deadline).
#[derive(Clone, Debug)]
pub struct MarkingVerifier {
    verifier: Verifier,
    core: Arc<Core>,
}

impl MarkingVerifier {
    pub fn new(verifier: Verifier, core: Arc<Core>) -> Self {
        MarkingVerifier { verifier, core }
    }
}

impl Interceptor for MarkingVerifier {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let method = req
            .extensions()
            .get::<CallMethod>()
            .ok_or_else(|| Status::internal("the call's method is unknown"))?;
        let header = req
            .metadata()
            .get(AUTH_HEADER)
            .and_then(|v| v.to_str().ok());
        let verified = check(&self.verifier, &self.core, header, &method.0)?;
        verified.check_unbound().map_err(|e| e.status())?;
        if let Some(auth) = req.extensions().get::<ConnAuth>() {
            auth.mark_call();
        }
        // The node calls' handlers check the node the credential speaks for.
        let mut req = req;
        req.extensions_mut().insert(verified);
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvpool_core::master::clock::SystemClock;
    use kvpool_core::master::state::{MasterConfig, MasterState};
    use kvpool_proto::auth::{AuthKey, Role};
    use tonic::Code;

    use super::*;
    use crate::metrics::MasterMetrics;

    fn core(standalone: bool) -> Arc<Core> {
        let metrics = MasterMetrics::new(&prometheus::Registry::new(), "lru").expect("metrics");
        let state = MasterState::new(MasterConfig::default(), Arc::new(SystemClock::new()));
        if standalone {
            Core::standalone(state, metrics)
        } else {
            Core::new(state, metrics)
        }
    }

    #[test]
    fn a_new_leader_refuses_credentials_made_before_it_took_over() {
        let pool = AuthKey::from_bytes(b"0123456789abcdef-pool").expect("key");
        let verifier = Verifier::new(&pool).expect("pool key");
        let engine = pool.derive(Role::Engine).expect("engine");
        let ha = core(false);
        let before = engine.sign("Get");
        // Made while another master led (this one a standby): after the takeover it is
        // refused with UNAVAILABLE, which the client retries with a fresh credential.
        std::thread::sleep(std::time::Duration::from_millis(5));
        ha.role.set_leader(true);
        let since = ha.role.leader_since_ms();
        assert!(since > 0);
        let early = engine.sign_at("Get", None, since - 1, 2);
        let e = check(&verifier, &ha, Some(&early), "Get").expect_err("before leadership");
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        let e = check(&verifier, &ha, Some(&before), "Get").expect_err("before leadership");
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        let fresh = engine.sign_at("Get", None, since, 3);
        assert_eq!(
            check(&verifier, &ha, Some(&fresh), "Get")
                .expect("fresh")
                .role,
            Role::Engine
        );
        // A standalone master has no predecessor: no cutoff.
        let alone = core(true);
        assert_eq!(alone.role.leader_since_ms(), 0);
        let old = engine.sign("Get");
        check(&verifier, &alone, Some(&old), "Get").expect("standalone");
        let e = check(
            &verifier,
            &alone,
            Some(&engine.sign("RemoveAll")),
            "AdoptReplicas",
        )
        .expect_err("wrong method");
        assert_eq!(e.code(), Code::Unauthenticated);
        let c = pool.derive(Role::Conductor).expect("conductor");
        let e = check(&verifier, &alone, Some(&c.sign("Remove")), "Remove").expect_err("role");
        assert_eq!(e.code(), Code::PermissionDenied);
    }
}
