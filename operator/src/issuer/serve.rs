//! The issuer's HTTPS endpoint: `POST /v1/agent-credentials` (see [`kvpool_proto::issuer`]).
//! Each call is one TokenReview, one pod read and one DaemonSet read; the answer is the
//! node's credential file, derived from the root key like the pool key itself. Connections
//! are bounded (count, TLS handshake, header and whole-connection deadlines) so that slow or
//! silent clients cannot hold the port. I/O boundary: the listener, the TLS streams and the
//! kube client.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use kvpool_proto::issuer::{AUDIENCE, IssueRequest, MAX_BODY, PATH, refusal_json};
use prometheus::IntCounterVec;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::review::{self, Grant, Refusal};
use crate::labels::{Component, child_name};
use crate::root_key::RootKey;

/// Connections served at once; more are closed at once.
const MAX_CONNECTIONS: usize = 64;
/// A TLS handshake, the request head, and a whole connection must finish within these.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// The API calls of one request, together.
const API_TIMEOUT: Duration = Duration::from_secs(15);

/// Failures that stop the issuer.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum IssuerError {
    #[error("cannot listen for agent credential requests on {addr}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] super::ca::CaError),
}

kvpool_runtime::error_category!(IssuerError);

/// What the handler needs.
#[derive(Clone, derive_more::Debug)]
pub struct IssuerState {
    #[debug(skip)]
    pub client: Client,
    pub root: RootKey,
    /// `kvpool_operator_agent_credentials_total{outcome}`.
    #[debug(skip)]
    pub outcomes: IntCounterVec,
}

fn refusal_response(r: &Refusal) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::FORBIDDEN);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        refusal_json(r.reason, &r.message),
    )
        .into_response()
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Refusal {
    Refusal {
        status: 503,
        reason: "api_unavailable",
        message: format!("{what}: {e}"),
    }
}

/// Review the token, read the pod and its DaemonSet, decide.
async fn decide(state: &IssuerState, token: &str, req: &IssueRequest) -> Result<Grant, Refusal> {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_owned()),
            audiences: Some(vec![AUDIENCE.to_owned()]),
        },
        ..TokenReview::default()
    };
    let reviewed = Api::<TokenReview>::all(state.client.clone())
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| unavailable("TokenReview", e))?;
    let caller = review::caller(&reviewed.status.unwrap_or_default())?;
    review::same_namespace(req, &caller)?;
    let pods = Api::<Pod>::namespaced(state.client.clone(), &req.namespace);
    let pod = pods
        .get_opt(&caller.pod_name)
        .await
        .map_err(|e| unavailable("reading the pod", e))?;
    let daemonsets = Api::<DaemonSet>::namespaced(state.client.clone(), &req.namespace);
    let ds = daemonsets
        .get_opt(&child_name(&req.pool, Component::Agent))
        .await
        .map_err(|e| unavailable("reading the agent DaemonSet", e))?;
    review::grant(req, &caller, pod.as_ref(), ds.as_ref())
}

async fn issue(State(state): State<Arc<IssuerState>>, headers: HeaderMap, body: Bytes) -> Response {
    let answer = async {
        let token = bearer(&headers).ok_or(Refusal {
            status: 401,
            reason: "no_token",
            message: "no `Authorization: Bearer <token>` header".to_owned(),
        })?;
        let req = IssueRequest::parse(&body).map_err(|message| Refusal {
            status: 400,
            reason: "bad_request",
            message,
        })?;
        let grant = tokio::time::timeout(API_TIMEOUT, decide(&state, token, &req))
            .await
            .map_err(|_| unavailable("the Kubernetes API", "no answer in time"))??;
        let key = state
            .root
            .pool_key_hex(&req.namespace, &req.pool, &grant.pool_uid);
        let file =
            kvpool_client::credentials::node_file(key.as_bytes(), &grant.node).ok_or(Refusal {
                status: 403,
                reason: "node_unbindable",
                message: format!("node name {:?} cannot be bound to a credential", grant.node),
            })?;
        info!(namespace = %req.namespace, pool = %req.pool, node = %grant.node,
            "issued an agent credential");
        Ok::<String, Refusal>(file)
    }
    .await;
    match answer {
        Ok(file) => {
            state.outcomes.with_label_values(&["issued"]).inc();
            (
                StatusCode::OK,
                [
                    (header::CONTENT_TYPE, "application/json"),
                    (header::CACHE_CONTROL, "no-store"),
                ],
                file,
            )
                .into_response()
        }
        Err(r) => {
            state.outcomes.with_label_values(&[r.reason]).inc();
            warn!(reason = r.reason, message = %r.message, "refused an agent credential");
            refusal_response(&r)
        }
    }
}

/// The issuer's routes.
pub fn router(state: Arc<IssuerState>) -> Router {
    Router::new()
        .route(PATH, post(issue))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// Bind the issuer's port.
pub async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, IssuerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| IssuerError::Listen { addr, source })
}

/// Serve `router` over TLS on `listener` until `stop`.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    router: Router,
    stop: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(tls);
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                warn!(error = %e, "accepting an agent credential connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Over the limit: closed at once rather than queued behind slow peers.
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            continue;
        };
        let acceptor = acceptor.clone();
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let conn = async {
                let Ok(Ok(tls)) =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                else {
                    return;
                };
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            };
            let _ = tokio::time::timeout(CONNECTION_DEADLINE, conn).await;
        });
    }
}
