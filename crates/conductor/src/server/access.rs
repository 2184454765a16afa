//! Who may call the conductor, and what of a call reaches the engines: optional API keys
//! (`--api-key-file`: a client must send `Authorization: Bearer <key>`, else 401 in OpenAI's
//! error shape), the request id (`x-request-id`, the client's or a new one, echoed in the
//! response) and the W3C trace context (`traceparent`, `tracestate`), which go to the engines
//! with every call made for the request, and the engines' own key (`--engine-api-key-file`) or,
//! without one, the client's `Authorization` as it came. Pure apart from reading the key files
//! at start ([`read_keys`]) and the random request ids.

use std::collections::HashSet;
use std::path::Path;

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use sha2::{Digest, Sha256};

/// Request and response header of the request id.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// W3C trace context headers, passed to the engines as they came.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];
/// Longest request id taken from a client; a longer one is replaced.
const MAX_REQUEST_ID: usize = 128;

/// Errors of reading a key file.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("cannot read the API key file {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the API key file {0} holds no key (one per line; blank lines and # comments are skipped)"
    )]
    Empty(std::path::PathBuf),
}

/// The keys of a key file: one per line, surrounding whitespace trimmed, blank lines and lines
/// starting with `#` skipped.
pub fn read_keys(path: &Path) -> Result<Vec<String>, KeyFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if keys.is_empty() {
        return Err(KeyFileError::Empty(path.to_owned()));
    }
    Ok(keys)
}

/// The API keys clients may present, kept as SHA-256 digests (compared whole, so the time a
/// comparison takes says nothing about a key).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ApiKeys(HashSet<[u8; 32]>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    pub fn new<S: AsRef<str>>(keys: &[S]) -> Self {
        Self(keys.iter().map(|k| digest(k.as_ref())).collect())
    }

    /// Whether `headers` carry one of the keys as `Authorization: Bearer <key>`.
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        bearer(headers).is_some_and(|k| self.0.contains(&digest(k)))
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Who may call, and how the engines are called.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Access {
    /// Keys a client must present; `None`: anyone the network lets in.
    pub api_keys: Option<ApiKeys>,
    /// The key the engines expect (`Authorization: Bearer` on every engine call); `None`: a
    /// client's own `Authorization` is passed on with its request.
    pub engine_api_key: Option<String>,
}

impl Access {
    /// The keys of the files `api_key_file` (client keys) and `engine_api_key_file` (exactly
    /// one key); an error names the flag (`api-key-file`, `engine-api-key-file`) and why.
    pub fn read(
        api_key_file: Option<&Path>,
        engine_api_key_file: Option<&Path>,
    ) -> Result<Self, (&'static str, String)> {
        let api_keys = match api_key_file {
            Some(path) => Some(ApiKeys::new(
                &read_keys(path).map_err(|e| ("api-key-file", e.to_string()))?,
            )),
            None => None,
        };
        let engine_api_key = match engine_api_key_file {
            Some(path) => {
                let keys = read_keys(path).map_err(|e| ("engine-api-key-file", e.to_string()))?;
                match keys.as_slice() {
                    [one] => Some(one.clone()),
                    _ => {
                        return Err((
                            "engine-api-key-file",
                            format!(
                                "{} holds {} keys; the engines' key is one",
                                path.display(),
                                keys.len()
                            ),
                        ));
                    }
                }
            }
            None => None,
        };
        Ok(Self {
            api_keys,
            engine_api_key,
        })
    }
}

/// The 401 a call without a valid key gets, in OpenAI's error shape.
pub fn unauthorized(headers: &HeaderMap) -> Response {
    let message = if headers.contains_key(header::AUTHORIZATION) {
        "Incorrect API key provided."
    } else {
        "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
    };
    let body = kvpool_proto::openai::error_body(
        message,
        "invalid_request_error",
        None,
        Some("invalid_api_key"),
    );
    let mut resp = (StatusCode::UNAUTHORIZED, Json(body)).into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// The headers every engine call made for one request carries, and its id.
#[derive(Clone, Debug, Default)]
pub struct Forward {
    pub request_id: String,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Forward {
    /// What of the client's `headers` goes on, under `access`: the request id (the client's
    /// when it is short printable ASCII, else a new one), the trace context, and the engines'
    /// key or the client's `Authorization`.
    pub fn from_client(headers: &HeaderMap, access: &Access) -> Self {
        let request_id = headers
            .get(REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID)
            .map_or_else(new_request_id, str::to_owned);
        let mut out = Vec::new();
        if let Ok(v) = HeaderValue::from_str(&request_id) {
            out.push((HeaderName::from_static(REQUEST_ID_HEADER), v));
        }
        for name in TRACE_HEADERS {
            if let Some(v) = headers.get(name) {
                out.push((HeaderName::from_static(name), v.clone()));
            }
        }
        let auth = match &access.engine_api_key {
            Some(key) => HeaderValue::from_str(&format!("Bearer {key}")).ok(),
            None => headers.get(header::AUTHORIZATION).cloned(),
        };
        if let Some(v) = auth {
            out.push((header::AUTHORIZATION, v));
        }
        Self {
            request_id,
            headers: out,
        }
    }

    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// These headers with `name` set to `value` (for one engine call of the request).
    pub fn with_header(&self, name: HeaderName, value: HeaderValue) -> Self {
        let mut out = self.clone();
        out.headers.retain(|(n, _)| *n != name);
        out.headers.push((name, value));
        out
    }

    /// Echo the request id on the client's `response`.
    pub fn tag(&self, mut response: Response) -> Response {
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            response.headers_mut().insert(REQUEST_ID_HEADER, v);
        }
        response
    }
}

/// A new request id: 32 random hex digits.
fn new_request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn keys_admit_their_bearer_tokens_only() {
        let keys = ApiKeys::new(&["sk-one", "sk-two"]);
        assert!(keys.admits(&headers(&[("authorization", "Bearer sk-two")])));
        assert!(keys.admits(&headers(&[("authorization", "bearer  sk-one ")])));
        for bad in ["Bearer sk-three", "Basic sk-one", "sk-one", "Bearer"] {
            assert!(!keys.admits(&headers(&[("authorization", bad)])), "{bad}");
        }
        assert!(!keys.admits(&HeaderMap::new()));
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)", "no key in logs");
    }

    #[test]
    fn key_files_skip_blanks_and_comments_and_must_hold_a_key() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("keys");
        std::fs::write(&p, "# clients\nsk-a\n\n  sk-b  \n").expect("write");
        assert_eq!(read_keys(&p).expect("keys"), ["sk-a", "sk-b"]);
        std::fs::write(&p, "# none\n\n").expect("write");
        let e = read_keys(&p).expect_err("empty");
        assert!(e.to_string().contains("holds no key"), "{e}");
        assert!(matches!(
            read_keys(&dir.path().join("missing")),
            Err(KeyFileError::Read { .. })
        ));
    }

    #[test]
    fn forwarded_headers_carry_the_id_the_trace_and_the_right_key() {
        let client = headers(&[
            ("authorization", "Bearer sk-client"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("x-request-id", "req-42"),
            ("cookie", "secret"),
        ]);
        let passed = Forward::from_client(&client, &Access::default());
        assert_eq!(passed.request_id, "req-42");
        let names: Vec<&str> = passed.headers().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["x-request-id", "traceparent", "tracestate", "authorization"]
        );
        let with_engine_key = Access {
            engine_api_key: Some("sk-engine".into()),
            ..Access::default()
        };
        let passed = Forward::from_client(&client, &with_engine_key);
        let auth = passed
            .headers()
            .iter()
            .find(|(n, _)| n == header::AUTHORIZATION)
            .map(|(_, v)| v.to_str().expect("ascii"));
        assert_eq!(auth, Some("Bearer sk-engine"));
        // No id, or an unusable one: a new one.
        let fresh = Forward::from_client(&HeaderMap::new(), &Access::default());
        assert_eq!(fresh.request_id.len(), 32);
        let long = "x".repeat(200);
        let replaced =
            Forward::from_client(&headers(&[("x-request-id", &long)]), &Access::default());
        assert_ne!(replaced.request_id, long);
    }
}
